"""Sampling parameters through a real `kvflow serve` (frontend, scheduler, worker and
detokenizer processes): /v1/completions bodies against transformers' reference
(tests/sampling_reference.py) and against the offline `kvflow.LLM` with the same seeds.

One server for the module. Responses carry text, not token ids; the tests recover ids
from each token's raw logprob (asked with logprobs=0), which transformers' logits pin
down, with the token's text to break ties.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from sampling_reference import (
    Reference,
    Spread,
    distribution_cases,
    penalty_cases,
    penalty_prompt,
    pick_spread,
    sampling_fields,
    tally_conditionals,
    token_fit,
)
from serve_harness import ENGINE_ARGS, MODEL_NAME, Server

from kvflow import LLM, SamplingParams

pytestmark = pytest.mark.slow

PROMPT_CANDIDATES = ["Once upon a time", "In 1999,", "My name is", "What is the", "Dear Sir,"]
TEMPERATURE = 0.25
REQUESTS, N = 8, 128  # 1024 samples of one next-token distribution (n is capped at 128)


def _option(name: str) -> str:
    return ENGINE_ARGS[ENGINE_ARGS.index(name) + 1]


@pytest.fixture(scope="module")
def offline(tiny_model_dir: Path) -> LLM:
    return LLM(
        str(tiny_model_dir),
        dtype=_option("--dtype"),
        device=_option("--device"),
        num_blocks=int(_option("--num-blocks")),
    )


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path) -> Reference:
    return Reference(tiny_model_dir)


def complete(server: Server, **body: Any) -> Any:
    body = {"model": MODEL_NAME, **body}
    if body.get("logit_bias"):
        body["logit_bias"] = {str(t): b for t, b in body["logit_bias"].items()}
    response = httpx.post(server.base_url + "/v1/completions", json=body, timeout=120.0)
    assert response.status_code == 200, response.text
    return response.json()


def complete_all(server: Server, bodies: list[dict[str, Any]]) -> list[Any]:
    """All at once, so the engine batches them together."""
    with ThreadPoolExecutor(len(bodies)) as pool:
        return list(pool.map(lambda body: complete(server, **body), bodies))


def texts(response: Any) -> list[str]:
    return [choice["text"] for choice in response["choices"]]


def offline_texts(offline: LLM, prompt: Any, **params: Any) -> list[str]:
    out = offline.generate([prompt], SamplingParams(**params))[0]
    return [completion.text for completion in out.outputs]


def token_ids(
    reference: Reference, tokenizer: Any, prompt: list[int], choices: list[Any]
) -> list[list[int]]:
    """The ids of the choices' tokens (all of one length), step by step: the one token
    whose raw logprob given the ids so far is the reported one (and whose text matches)."""
    ids: list[list[int]] = [[] for _ in choices]
    for step in range(len(choices[0]["logprobs"]["tokens"])):
        prefixes = sorted({tuple(row) for row in ids})  # 1024 samples of one step: 1 row
        logits = reference.last_logits([prompt + list(prefix) for prefix in prefixes])
        logprobs = dict(zip(prefixes, logits.log_softmax(dim=1)))
        for row, choice in enumerate(choices):
            reported = choice["logprobs"]["token_logprobs"][step]
            close = (logprobs[tuple(ids[row])] - reported).abs() < 1e-4
            found = close.nonzero().squeeze(1).tolist()
            if len(found) > 1:
                text = choice["logprobs"]["tokens"][step]
                found = [t for t in found if tokenizer.decode([t]) == text]
            assert len(found) == 1, (step, reported, found)
            ids[row].append(found[0])
    return ids


def test_seeded_completion_ignores_the_batch_and_matches_offline(
    server: Server, offline: LLM
) -> None:
    seeded = {
        "prompt": "Once upon a time",
        "temperature": 0.8,
        "top_p": 0.9,
        "seed": 1234,
        "max_tokens": 12,
        "ignore_eos": True,
        "logprobs": 0,
    }
    alone = complete(server, **seeded)["choices"][0]
    others = [
        {"prompt": "A much longer prompt, " * 8, "temperature": 0, "max_tokens": 30},
        {"prompt": "Dear Sir,", "n": 4, "max_tokens": 20, "ignore_eos": True},
        {"prompt": "In 1999,", "top_k": 300, "frequency_penalty": 1.0, "max_tokens": 25},
        {"prompt": "What is", "repetition_penalty": 1.3, "seed": 5, "max_tokens": 16},
    ]
    batched = complete_all(server, [*others, seeded])[-1]["choices"][0]
    assert batched["text"] == alone["text"]
    assert batched["logprobs"]["token_logprobs"] == pytest.approx(
        alone["logprobs"]["token_logprobs"], abs=1e-4
    )
    params = {k: v for k, v in seeded.items() if k != "prompt"}
    assert offline_texts(offline, seeded["prompt"], **params) == [alone["text"]]


@pytest.fixture(scope="module")
def spread(offline: LLM, reference: Reference) -> Spread:
    prompts = [offline.tokenizer.encode(text) for text in PROMPT_CANDIDATES]
    return pick_spread(reference, prompts, TEMPERATURE)


@pytest.mark.parametrize("case", ["top_p", "min_p"])
def test_next_token_distribution_matches_transformers(
    server: Server, offline: LLM, reference: Reference, spread: Spread, case: str
) -> None:
    spec, bugs = distribution_cases(spread, TEMPERATURE)[case]
    body = {"prompt": spread.prompt, "max_tokens": 1, "logprobs": 0, "n": N, "ignore_eos": True}
    bodies = [{**body, **sampling_fields(spec), "seed": 1000 * i} for i in range(REQUESTS)]
    choices = [c for response in complete_all(server, bodies) for c in response["choices"]]
    tokens = [ids[0] for ids in token_ids(reference, offline.tokenizer, spread.prompt, choices)]

    fit = token_fit(spread.next_probs(spec), tokens)
    assert not fit.rejected, f"{case}: {fit}"
    for bug in bugs:
        bug_fit = token_fit(spread.next_probs(bug), tokens)
        assert bug_fit.rejected, f"the test cannot tell {spec} from {bug}: {bug_fit}"


def test_frequency_penalty_matches_transformers_over_the_real_history(
    server: Server, offline: LLM, reference: Reference
) -> None:
    spec, bugs = penalty_cases()["frequency"]
    prompt = penalty_prompt(offline.tokenizer)
    params = {**sampling_fields(spec), "n": N, "max_tokens": 8, "ignore_eos": True}
    seeds = [2, 3]  # 256 samples
    bodies = [{"prompt": prompt, "logprobs": 0, "seed": seed, **params} for seed in seeds]
    choices = [c for response in complete_all(server, bodies) for c in response["choices"]]
    outputs = token_ids(reference, offline.tokenizer, prompt, choices)

    tallies, _ = tally_conditionals(reference, prompt, outputs, {"spec": spec, **bugs})
    fit = tallies["spec"].fit()
    assert not fit.rejected, str(fit)
    for name in bugs:
        assert tallies[name].fit().rejected, f"the test cannot tell {name}: {tallies[name].fit()}"
    offline_outs = offline.generate(
        [prompt] * len(seeds), [SamplingParams(seed=seed, **params) for seed in seeds]
    )
    assert outputs == [c.token_ids for out in offline_outs for c in out.outputs]


def test_min_tokens_eos_and_stop_token_ids(server: Server, offline: LLM) -> None:
    (eos,) = offline.engine.eos_token_ids
    prompt = "Once upon a time"
    likely_eos: dict[str, Any] = {"logit_bias": {eos: 100.0}, "max_tokens": 20, "seed": 3}
    response = complete(server, prompt=prompt, min_tokens=5, **likely_eos)
    assert response["choices"][0]["finish_reason"] == "stop"
    assert response["usage"]["completion_tokens"] == 6  # 5, then the EOS
    assert texts(response) == offline_texts(offline, prompt, min_tokens=5, **likely_eos)

    response = complete(server, prompt=prompt, **likely_eos)
    assert (texts(response), response["usage"]["completion_tokens"]) == ([""], 1)

    stop = offline.tokenizer.encode(" Hello")[-1]
    likely_stop: dict[str, Any] = {"logit_bias": {stop: 100.0}, "stop_token_ids": [stop], "seed": 4}
    response = complete(server, prompt=prompt, min_tokens=2, **likely_stop)
    choice = response["choices"][0]
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", stop)
    assert response["usage"]["completion_tokens"] == 3
    assert [choice["text"]] == offline_texts(offline, prompt, min_tokens=2, **likely_stop)
    assert not choice["text"].endswith(" Hello")
    response = complete(
        server, prompt=prompt, min_tokens=2, include_stop_str_in_output=True, **likely_stop
    )
    assert texts(response) == [choice["text"] + " Hello"]


def test_n_choices_differ_and_reproduce(server: Server, offline: LLM) -> None:
    body = {"prompt": "Once upon a time", "n": 3, "seed": 5, "max_tokens": 8, "ignore_eos": True}
    first = complete(server, **body)
    assert [choice["index"] for choice in first["choices"]] == [0, 1, 2]
    assert len(set(texts(first))) == 3, texts(first)
    assert texts(complete(server, **body)) == texts(first)
    params = {k: v for k, v in body.items() if k != "prompt"}
    assert offline_texts(offline, body["prompt"], **params) == texts(first)
