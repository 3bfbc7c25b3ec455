"""`kvflow bench guided --goals`: the structured-outputs issue's goals, measured offline.

- valid-output rate: `--goals-batch` chat requests (concurrency = batch) for a person
  schema at temperature 1.0, each with its own seed; an output counts as valid when it
  parses and validates (`jsonschema`); one cut by max_tokens counts as invalid.
- cached-schema TTFT: a one-token request with a schema already in the cache against the
  same request without a schema, interleaved; the median difference is what the guided
  path (grammar hand-off, matcher, mask) adds before the first token.
- jump-forward: the same batch greedy on two engines, jump-forward on and off: steps,
  tok/s, tokens jumped, and whether every output is token for token the same.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 16},
        "kind": {"const": "person"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["administrator", "engineer", "teacher"]},
        "languages": {"type": "array", "items": {"enum": ["en", "fr", "de"]}, "maxItems": 2},
    },
    "required": ["name", "kind", "age", "role", "languages"],
    "additionalProperties": False,
}


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--goals", action="store_true", help="also measure the issue's goals")
    parser.add_argument("--goals-batch", type=int, default=32)
    parser.add_argument("--goals-max-tokens", type=int, default=160)


def measure(llm: Any, args: argparse.Namespace) -> dict[str, Any]:
    from kvflow.cli.args import engine_options
    from kvflow.offline.llm import LLM

    report = {"valid": _valid_rate(llm, args), "cached_ttft": _cached_ttft(llm)}
    options = engine_options(args)
    jump_on = options.get("grammar_jump_forward", True)
    other = LLM(**{**options, "grammar_jump_forward": not jump_on})
    on, off = (llm, other) if jump_on else (other, llm)
    report["jump_forward"] = _jump_forward(on, off, args)
    return report


def _conversations(batch: int) -> list[list[dict[str, str]]]:
    topics = ["a nurse", "a pilot", "a chef", "a painter", "a farmer", "a judge", "a coder"]
    return [
        [{"role": "user", "content": f"Describe {topics[i % len(topics)]} (#{i}) as JSON."}]
        for i in range(batch)
    ]


def _params(max_tokens: int, temperature: float, seed: int | None = None) -> Any:
    from kvflow.sampling_params import SamplingParams, StructuredOutputsParams

    return SamplingParams(
        max_tokens=max_tokens,
        temperature=temperature,
        seed=seed,
        structured_outputs=StructuredOutputsParams(json=PERSON),
    )


def _valid_rate(llm: Any, args: argparse.Namespace) -> dict[str, Any]:
    import jsonschema

    batch = args.goals_batch
    params = [_params(args.goals_max_tokens, 1.0, seed) for seed in range(batch)]
    outputs = llm.chat(_conversations(batch), params)
    valid = cut = 0
    for output in outputs:
        sample = output.outputs[0]
        if sample.finish_reason == "length":
            cut += 1
            continue
        try:
            jsonschema.validate(json.loads(sample.text), PERSON)
            valid += 1
        except (ValueError, jsonschema.ValidationError):
            pass
    return {"requests": batch, "valid": valid, "cut_by_max_tokens": cut}


def _cached_ttft(llm: Any, repeats: int = 15) -> dict[str, float]:
    from kvflow.sampling_params import SamplingParams

    prompt = [{"role": "user", "content": "Describe a person as JSON."}]
    plain = SamplingParams(max_tokens=1, temperature=0.0)
    guided = _params(1, 0.0)
    llm.chat(prompt, guided)  # compiled and cached
    plain_s: list[float] = []
    guided_s: list[float] = []
    for _ in range(repeats):
        for params, times in ((plain, plain_s), (guided, guided_s)):
            start = time.perf_counter()
            llm.chat(prompt, params)
            times.append(time.perf_counter() - start)
    plain_ms, guided_ms = statistics.median(plain_s) * 1e3, statistics.median(guided_s) * 1e3
    return {
        "plain_ms": round(plain_ms, 2),
        "guided_cached_ms": round(guided_ms, 2),
        "added_ms": round(guided_ms - plain_ms, 2),
    }


def _jump_forward(on: Any, off: Any, args: argparse.Namespace) -> dict[str, Any]:
    conversations = _conversations(args.goals_batch)
    params = _params(args.goals_max_tokens, 0.0)
    runs = {}
    for name, llm in (("off", off), ("on", on)):
        llm.chat(conversations[:1], params)  # compiled, warm
        core = llm.engine.core
        steps, jumped = core.counters.num_steps, core.scheduler.num_jump_forward_tokens
        start = time.perf_counter()
        outputs = llm.chat(conversations, params)
        elapsed = time.perf_counter() - start
        tokens = [list(o.outputs[0].token_ids) for o in outputs]
        runs[name] = {
            "tokens": tokens,
            "steps": core.counters.num_steps - steps,
            "jumped": core.scheduler.num_jump_forward_tokens - jumped,
            "tok_s": sum(map(len, tokens)) / elapsed,
        }
    on_run, off_run = runs["on"], runs["off"]
    return {
        "identical": on_run["tokens"] == off_run["tokens"],
        "output_tokens": sum(map(len, on_run["tokens"])),
        "tokens_jumped": on_run["jumped"],
        "steps_off": off_run["steps"],
        "steps_on": on_run["steps"],
        "tok_s_off": round(off_run["tok_s"], 1),
        "tok_s_on": round(on_run["tok_s"], 1),
    }


def print_goals(goals: dict[str, Any]) -> None:
    valid, ttft, jump = goals["valid"], goals["cached_ttft"], goals["jump_forward"]
    print(
        f"valid outputs: {valid['valid']}/{valid['requests']} "
        f"(cut by max_tokens: {valid['cut_by_max_tokens']})"
    )
    print(
        f"TTFT: plain {ttft['plain_ms']:.2f} ms, cached schema {ttft['guided_cached_ms']:.2f} ms "
        f"(+{ttft['added_ms']:.2f} ms)"
    )
    print(
        f"jump-forward: {jump['tokens_jumped']} of {jump['output_tokens']} tokens jumped, "
        f"steps {jump['steps_off']} -> {jump['steps_on']}, tok/s {jump['tok_s_off']} -> "
        f"{jump['tok_s_on']}, identical outputs: {jump['identical']}"
    )
