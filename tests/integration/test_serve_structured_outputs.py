"""Structured outputs and tool calling through a real `kvflow serve`, with the `openai`
client: the embedded SmolLM2 (a real chat model) at temperature 1.0, so the grammar,
not luck, is what makes every output valid."""

from __future__ import annotations

import itertools
import json
import re
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest
from serve_harness import MODEL_NAME, Server, start_server, stop_server, wait_for

from kvflow.gpu_worker.model_files import resolve_model_dir

openai = pytest.importorskip("openai")

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pets": {"type": "array", "items": {"enum": ["cat", "dog"]}, "maxItems": 2},
    },
    "required": ["name", "age", "pets"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 16},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["UTC", "CET", "PST"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
ASK = [{"role": "user", "content": "What is the weather in Paris, and the time in UTC?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = start_server(Path(resolve_model_dir(None)), tmp_path_factory.mktemp("serve"))
    yield srv
    code, survivors = stop_server(srv)
    assert survivors == [] and code == 0, srv.log_tail()


@pytest.fixture(scope="module")
def client(server: Server) -> Any:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0)


def chat(client: Any, **kwargs: Any) -> Any:
    kwargs.setdefault("messages", [{"role": "user", "content": "Describe a person."}])
    kwargs.setdefault("max_tokens", 120)
    return client.chat.completions.create(model=MODEL_NAME, temperature=1.0, **kwargs)


def test_json_schema_outputs_parse_and_validate(client: Any) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    response = chat(client, response_format=fmt, n=4, seed=7)
    for choice in response.choices:
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content), PERSON)


def test_json_object_and_legacy_guided_json_on_completions(client: Any) -> None:
    response = chat(client, response_format={"type": "json_object"}, max_tokens=200)
    if response.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(response.choices[0].message.content), dict)
    completion = client.completions.create(
        model=MODEL_NAME,
        prompt="A person as JSON:",
        max_tokens=120,
        temperature=1.0,
        extra_body={"guided_json": PERSON, "guided_whitespace_pattern": r"[ ]?"},
    )
    text = completion.choices[0].text
    jsonschema.validate(json.loads(text), PERSON)
    assert "\n" not in text  # the whitespace pattern allows single spaces only


def test_regex_choice_and_gbnf(client: Any) -> None:
    regex = r"[A-Z][a-z]{2,6} [0-9]{2}"
    out = chat(client, extra_body={"structured_outputs": {"regex": regex}})
    assert re.fullmatch(regex, out.choices[0].message.content)
    colors = ["red", "green", "light blue"]
    out = chat(client, n=3, extra_body={"guided_choice": colors})
    assert all(c.message.content in colors for c in out.choices)
    gbnf = '# sums\nroot ::= num (" + " num){1,3}\nnum ::= [1-9][0-9]{0,2}\n'
    out = client.completions.create(
        model=MODEL_NAME, prompt="1 + 2 =", max_tokens=40, temperature=1.0,
        extra_body={"structured_outputs": {"grammar": gbnf}},
    )  # fmt: skip
    assert re.fullmatch(r"[1-9][0-9]{0,2}( \+ [1-9][0-9]{0,2}){1,3}", out.choices[0].text)


BAD_SCHEMA = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}
UNKNOWN_TOOL = {"type": "function", "function": {"name": "nope"}}


def test_grammar_metrics_count_compiles_and_hits(server: Server, client: Any) -> None:
    before = _metric(server, "kvflow:grammar_cache_hits_total", default=0.0)
    regex = r"metrics-[0-9]{2}"
    for _ in range(2):
        out = chat(client, extra_body={"guided_regex": regex}, max_tokens=8)
        assert re.fullmatch(regex, out.choices[0].message.content)
    assert wait_for(
        lambda: _metric(server, "kvflow:grammar_cache_hits_total", default=0.0) >= before + 1,
        timeout_s=5.0,
    )
    text = httpx.get(server.base_url + "/metrics", timeout=10).text
    (line,) = [x for x in text.splitlines() if x.startswith("kvflow:guided_requests_total{")
               and 'kind="regex"' in x]  # fmt: skip
    assert float(line.split()[-1]) >= 2
    assert _metric(server, "kvflow:grammar_cache_misses_total", default=0.0) >= 1
    # Each ended on its stop token, forced by the finished regex: jumped, not sampled.
    assert _metric(server, "kvflow:grammar_jump_forward_tokens_total", default=0.0) >= 2


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"response_format": BAD_SCHEMA}, "response_format"),
        ({"structured_outputs": {"regex": "(ab"}}, "structured_outputs"),
        ({"guided_grammar": "root ::= ("}, "guided_grammar"),
        ({"guided_choice": []}, "guided_choice"),
        ({"tools": [WEATHER], "tool_choice": UNKNOWN_TOOL}, "tool_choice"),
        ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex"),
    ],
)
def test_bad_constraints_are_400_naming_the_field(
    server: Server, body: dict[str, Any], param: str
) -> None:
    body = {"model": MODEL_NAME, "messages": ASK, "max_tokens": 4, **body}
    response = httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error


def _json_schema_format(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


MISSHAPEN = [{"type": "object", "properties": 5}, {"$defs": 1}]
EMPTY_LANGUAGE = [
    ({"grammar": "root ::= root"}, {"guided_grammar": "root ::= root"}),
    ({"regex": "[^\\s\\S]"}, {"guided_regex": "[^\\s\\S]"}),
    ({"json": {"$ref": "#"}}, {"guided_json": {"$ref": "#"}}),
    (
        {"json": {"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}},
        {"guided_json": {"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}},
    ),
]


def _constraint_cases() -> list[tuple[dict[str, Any], str, str]]:
    """(request fields, the param named, words of the message) of every 400 case."""
    cases = []
    for schema in MISSHAPEN:
        words = "must be an object"
        cases += [
            ({"response_format": _json_schema_format(schema)}, "response_format", words),
            ({"structured_outputs": {"json": schema}}, "structured_outputs", words),
            ({"guided_json": schema}, "guided_json", words),
        ]
    for modern, legacy in EMPTY_LANGUAGE:
        (name,) = legacy
        cases += [
            ({"structured_outputs": modern}, "structured_outputs", "matches no text"),
            (legacy, name, "matches no text"),
        ]
    (schema,) = EMPTY_LANGUAGE[2][0].values()
    cases.append(({"response_format": _json_schema_format(schema)}, "response_format", "no text"))
    return cases


@pytest.mark.parametrize(("fields", "param", "words"), _constraint_cases())
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_misshapen_or_unsatisfiable_constraints_are_400s(
    server: Server, path: str, fields: dict[str, Any], param: str, words: str
) -> None:
    """Were 500s (an AttributeError on a schema's map) or failed inside the engine (a
    constraint no text satisfies leaves no allowed token)."""
    prompt = {"messages": ASK} if path.endswith("chat/completions") else {"prompt": "Hi"}
    body = {"model": MODEL_NAME, "max_tokens": 4, **prompt, **fields}
    response = httpx.post(server.base_url + path, json=body, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    assert words in error["message"], error


@pytest.mark.parametrize("parallel", [True, False])
def test_tool_choice_required_gives_valid_calls(client: Any, parallel: bool) -> None:
    for seed in range(3):
        response = chat(
            client, messages=ASK, tools=[WEATHER, TIME], tool_choice="required",
            parallel_tool_calls=parallel, seed=seed, max_tokens=160,
        )  # fmt: skip
        choice = response.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        calls = choice.message.tool_calls
        assert calls and (parallel or len(calls) == 1)
        for call in calls:
            jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.slow
def test_fifty_two_tool_calls_validate_required_and_named_streaming_and_not(
    client: Any,
) -> None:
    """13 cases each of tool_choice required / named x streaming / not, concurrently, at
    temperature 1.0: every call's arguments validate against its function's schema."""
    named = {"type": "function", "function": {"name": "get_time"}}
    cases = list(itertools.product(["required", "named"], [False, True], range(13)))

    def one(case: tuple[str, bool, int]) -> list[tuple[str, str]]:
        kind, stream, seed = case
        response = chat(
            client, messages=ASK, tools=[WEATHER, TIME], seed=seed, max_tokens=160,
            tool_choice="required" if kind == "required" else named, stream=stream,
            parallel_tool_calls=False,
        )  # fmt: skip
        calls = _streamed_calls(response) if stream else _whole_calls(response)
        assert len(calls) == 1, case
        if kind == "named":
            assert [name for name, _ in calls] == ["get_time"], case
        return calls

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, cases))
    assert len(results) == 52
    for calls in results:
        for name, arguments in calls:
            jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def _whole_calls(response: Any) -> list[tuple[str, str]]:
    choice = response.choices[0]
    assert choice.finish_reason in ("tool_calls", "stop"), choice  # never "length"
    return [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]


def _streamed_calls(stream: Any) -> list[tuple[str, str]]:
    calls: dict[int, list[str]] = {}
    finish = None
    for chunk in stream:
        for choice in chunk.choices:
            for call in choice.delta.tool_calls or []:
                entry = calls.setdefault(call.index, ["", ""])
                entry[0] += call.function.name or ""
                entry[1] += call.function.arguments or ""
            finish = choice.finish_reason or finish
    assert finish in ("tool_calls", "stop"), finish
    return [(name, arguments) for name, arguments in calls.values()]


def test_named_tool_choice_streams_deltas_that_reassemble(client: Any) -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    stream = chat(client, messages=ASK, tools=[WEATHER, TIME], tool_choice=named, stream=True)
    ids, names, arguments, finish = set(), set(), "", None
    for chunk in stream:
        for choice in chunk.choices:
            for call in choice.delta.tool_calls or []:
                assert call.index == 0
                ids |= {call.id} - {None}
                names |= {call.function.name} - {None}
                arguments += call.function.arguments or ""
            finish = choice.finish_reason or finish
    assert len(ids) == 1 and names == {"get_weather"} and finish == "stop"
    jsonschema.validate(json.loads(arguments), SCHEMAS["get_weather"])


def test_required_tool_calls_stream_whole(client: Any) -> None:
    stream = chat(client, messages=ASK, tools=[WEATHER, TIME], tool_choice="required",
                  stream=True, max_tokens=160, seed=3)  # fmt: skip
    calls: dict[int, dict[str, str]] = {}
    for chunk in stream:
        for choice in chunk.choices:
            for call in choice.delta.tool_calls or []:
                entry = calls.setdefault(call.index, {"name": "", "arguments": ""})
                entry["name"] += call.function.name or ""
                entry["arguments"] += call.function.arguments or ""
    assert calls
    for entry in calls.values():
        jsonschema.validate(json.loads(entry["arguments"]), SCHEMAS[entry["name"]])


def test_tool_choice_auto_and_none_answer_in_openai_shape(client: Any) -> None:
    response = chat(client, messages=ASK, tools=[WEATHER], tool_choice="auto", max_tokens=60)
    message = response.choices[0].message
    for call in message.tool_calls or []:  # the model decides; any call it makes parses
        assert call.function.name == "get_weather"
        json.loads(call.function.arguments)
    assert message.tool_calls or message.content is not None
    response = chat(client, messages=ASK, tools=[WEATHER], tool_choice="none", max_tokens=8)
    assert not response.choices[0].message.tool_calls


def test_a_slow_compile_does_not_stall_other_requests(server: Server, client: Any) -> None:
    """While a large schema compiles, a plain stream keeps getting tokens."""
    big = {
        "type": "object",
        "properties": {
            f"f{i}": {"anyOf": [{"type": "string", "pattern": "[a-z]{1,8}"},
                                {"type": "integer", "minimum": i},
                                {"type": "array", "items": {"type": "number"}, "maxItems": 4}]}
            for i in range(150)
        },
    }  # fmt: skip
    arrivals: list[float] = []
    stream = client.completions.create(
        model=MODEL_NAME, prompt="Once upon a time", max_tokens=60, temperature=0.0,
        stream=True, extra_body={"ignore_eos": True},
    )  # fmt: skip
    next(iter(stream))  # the plain request is decoding
    guided: dict[str, float] = {}

    def send_guided() -> None:
        start = time.monotonic()
        chat(client, max_tokens=4, response_format={
            "type": "json_schema", "json_schema": {"name": "big", "schema": big}})  # fmt: skip
        guided["took"] = time.monotonic() - start
        guided["done"] = time.monotonic()

    thread = threading.Thread(target=send_guided)
    thread.start()
    start = time.monotonic()
    for _ in stream:
        arrivals.append(time.monotonic() - start)
    thread.join()
    compile_s = _metric(server, "kvflow:grammar_compile_seconds_sum")
    gaps = [b - a for a, b in itertools.pairwise(arrivals)]
    assert compile_s > 0.3, compile_s  # the schema really took a while to compile
    assert max(gaps) < compile_s, (max(gaps), compile_s)  # no gap as long as the compile


def _metric(server: Server, name: str, default: float | None = None) -> float:
    """The first sample whose line starts with `name` (labels may follow)."""
    for line in httpx.get(server.base_url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name):
            return float(line.split()[-1])
    if default is None:
        raise AssertionError(f"{name} not in /metrics")
    return default


CORPUS = json.loads((Path(__file__).parents[1] / "data" / "json_schema_corpus.json").read_text())


def _guided_json(client: Any, schema: dict[str, Any], seed: int) -> Any:
    fmt = {"type": "json_schema", "json_schema": {"name": "corpus", "schema": schema}}
    messages = [{"role": "user", "content": "Reply with a JSON value."}]
    return chat(client, messages=messages, response_format=fmt, seed=seed, max_tokens=300)


def test_schema_corpus_outputs_validate_or_are_refused(client: Any) -> None:
    """Every corpus schema at temperature 1.0: a finished output validates, or the schema
    uses a feature declared unsupported and the answer is a 400. A schema may allow
    unbounded output (a number's digits, a free string), so an output may also be cut
    by max_tokens: that must say "length", be a prefix the schema's grammar allows (the
    constraint held up to the cut) and stay a minority."""
    prefix_ok = _grammar_prefix_checker()

    def one(index: int) -> str:
        entry = CORPUS[index]
        try:
            response = _guided_json(client, entry["schema"], seed=index)
        except openai.BadRequestError as exc:
            ok = entry["expect"] == "unsupported" and "unsupported" in str(exc)
            return "refused" if ok else f"{entry['name']}: unexpected 400: {exc}"
        if entry["expect"] == "unsupported":
            return f"{entry['name']}: accepted a schema declared unsupported"
        choice = response.choices[0]
        if choice.finish_reason == "length":
            ok = prefix_ok(entry["schema"], choice.message.content)
            return "length" if ok else f"{entry['name']}: cut output leaves the grammar"
        try:
            jsonschema.validate(json.loads(choice.message.content), entry["schema"])
        except (ValueError, jsonschema.ValidationError) as exc:
            return f"{entry['name']} ({choice.finish_reason}): {choice.message.content!r}: {exc}"
        return "valid"

    with ThreadPoolExecutor(16) as pool:
        outcomes = list(pool.map(one, range(len(CORPUS))))
    failures = [o for o in outcomes if o not in ("valid", "refused", "length")]
    assert len(CORPUS) >= 200 and failures == [], "\n".join(failures)
    assert outcomes.count("refused") == sum(e["expect"] == "unsupported" for e in CORPUS)
    assert outcomes.count("length") <= len(CORPUS) // 4, outcomes.count("length")


def _grammar_prefix_checker() -> Any:
    """(schema, text) -> whether text is a prefix of some output the schema's grammar
    allows (built as the server builds it)."""
    import xgrammar as xgr

    from kvflow.sampling_params import StructuredOutputsParams
    from kvflow.structured_outputs import build_grammar
    from kvflow.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(Path(resolve_model_dir(None)))
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer))
    compiler = xgr.GrammarCompiler(info, max_threads=1)
    lock = threading.Lock()  # called from the test's request threads

    def check(schema: dict[str, Any], text: str) -> bool:
        grammar = build_grammar(StructuredOutputsParams(json=schema))
        with lock:
            matcher = xgr.GrammarMatcher(compiler.compile_grammar(grammar))
            return bool(matcher.accept_string(text)) and not matcher.is_terminated()

    return check


def test_mixed_batch_guided_valid_and_plain_unchanged(client: Any) -> None:
    """8 schemas x 3 guided requests beside 8 plain greedy ones: every guided output
    validates, and each plain output equals the same request run alone."""
    schemas = [entry["schema"] for entry in CORPUS[:8]]
    prompts = [f"Write one sentence about the number {i}." for i in range(8)]

    def plain(prompt: str) -> str:
        out = client.completions.create(
            model=MODEL_NAME, prompt=prompt, max_tokens=24, temperature=0.0
        )
        return str(out.choices[0].text)

    alone = [plain(p) for p in prompts]
    with ThreadPoolExecutor(32) as pool:
        guided = [pool.submit(_guided_json, client, schemas[i % 8], i) for i in range(24)]
        together = list(pool.map(plain, prompts))
        outputs = [(i % 8, f.result().choices[0]) for i, f in enumerate(guided)]
    assert together == alone
    for index, choice in outputs:
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content), schemas[index])
