"""`kvflow run-batch`: an OpenAI batch file answered offline, for real (a subprocess of
the console script on the embedded model), against the offline `LLM`'s own answers.

Greedy float32 on CPU in both processes: the same kernels run the same prompts, so the
tokens agree. Bad lines (malformed JSON, a bad body, an unknown url, /v1/embeddings)
become error records in place and the other lines still run. A run whose engine step
fails writes nothing: the previous output file stays whole, and no temp file is left.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
from serve_harness import KVFLOW

from kvflow import LLM, SamplingParams
from kvflow.cli.run_batch import run_file

pytestmark = pytest.mark.slow

MAX_TOKENS = 8
ENGINE_FLAGS = ["--dtype", "float32", "--device", "cpu", "--num-blocks", "64"]
PROMPTS = ["The capital of France is", "Once upon a time"]
CHATS = [
    [{"role": "user", "content": "Say hello."}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}],
]


def _line(custom_id: str, url: str, body: dict[str, Any]) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


def _greedy() -> dict[str, Any]:
    return {"max_tokens": MAX_TOKENS, "temperature": 0}


def _batch_lines() -> list[str]:
    completions = [
        _line(f"cmpl-{i}", "/v1/completions", {"prompt": p, **_greedy()})
        for i, p in enumerate(PROMPTS)
    ]
    chats = [
        _line(f"chat-{i}", "/v1/chat/completions", {"messages": m, **_greedy()})
        for i, m in enumerate(CHATS)
    ]
    return [
        completions[0],
        "{not json",
        chats[0],
        _line("embed", "/v1/embeddings", {"input": "hello"}),
        completions[1],
        _line("bad-body", "/v1/completions", {"prompt": "x", "n": 0}),
        _line("bad-url", "/v1/unknown", {}),
        chats[1],
    ]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(dtype="float32", device="cpu", num_blocks=64)  # model=None: the embedded one


def _expected(llm: LLM) -> dict[str, str]:
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    texts = {f"cmpl-{i}": o.outputs[0].text for i, o in enumerate(llm.generate(PROMPTS, params))}
    chats = llm.chat(CHATS, params)  # type: ignore[arg-type]
    texts.update({f"chat-{i}": o.outputs[0].text for i, o in enumerate(chats)})
    return texts


def _text(record: dict[str, Any]) -> str:
    body = record["response"]["body"]
    choice = body["choices"][0]
    return str(
        choice["text"] if body["object"] == "text_completion" else choice["message"]["content"]
    )


def test_subprocess_answers_like_offline_llm_and_records_bad_lines(
    llm: LLM, tmp_path: Path
) -> None:
    requests = tmp_path / "requests.jsonl"
    requests.write_text("\n".join(_batch_lines()) + "\n")
    results = tmp_path / "results.jsonl"
    command = [str(KVFLOW), "run-batch", "-i", str(requests), "-o", str(results), *ENGINE_FLAGS]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]

    records = [json.loads(line) for line in results.read_text().splitlines()]
    ids = [r["custom_id"] for r in records]
    assert ids == ["cmpl-0", None, "chat-0", "embed", "cmpl-1", "bad-body", "bad-url", "chat-1"]
    assert all(r["id"].startswith("batch_req_") for r in records)
    expected = _expected(llm)
    for record in records:
        if record["custom_id"] in expected:
            assert record["error"] is None
            response = record["response"]
            assert response["status_code"] == 200
            assert response["request_id"] == response["body"]["id"]
            assert response["body"]["usage"]["completion_tokens"] <= MAX_TOKENS
            assert _text(record) == expected[record["custom_id"]], record
        else:
            assert record["response"] is None
            assert record["error"]["code"] == 400, record
    errors = {r["custom_id"]: r["error"]["message"] for r in records if r["error"]}
    assert "--runner pooling" in errors["embed"]  # a generating engine refuses embeddings
    assert "'n'" in errors["bad-body"]  # the server's own message names the field
    assert "unknown url" in errors["bad-url"]
    assert "malformed" in errors[None]


def test_failed_engine_step_leaves_previous_output_whole(
    llm: LLM, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    results = tmp_path / "results.jsonl"
    results.write_text("previous run\n")
    real_step = llm.engine.step_deltas
    steps = 0

    def failing_step() -> Any:
        nonlocal steps
        steps += 1
        if steps == 3:
            raise RuntimeError("the engine failed midway")
        return real_step()

    monkeypatch.setattr(llm.engine, "step_deltas", failing_step)
    lines = [line.encode() for line in _batch_lines()]
    with pytest.raises(RuntimeError, match="midway"):
        run_file(llm, lines, str(results))
    assert results.read_text() == "previous run\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results.jsonl"]  # no temp file
    fresh = tmp_path / "fresh.jsonl"
    with pytest.raises(RuntimeError, match="midway"):
        steps = 2
        run_file(llm, lines, str(fresh))
    assert not fresh.exists()

    monkeypatch.undo()  # the engine recovered: the next run answers every line
    run_file(llm, lines, str(fresh))
    assert len(fresh.read_text().splitlines()) == len(lines)


def test_write_output_is_all_or_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from kvflow.cli import run_batch

    results = tmp_path / "results.jsonl"
    results.write_text("previous run\n")

    def no_disk(fd: int) -> None:
        raise OSError("disk gone")

    monkeypatch.setattr(run_batch.os, "fsync", no_disk)
    with pytest.raises(OSError, match="disk gone"):
        run_batch.write_output(str(results), b'{"new": 1}\n')
    assert results.read_text() == "previous run\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results.jsonl"]

    monkeypatch.undo()
    run_batch.write_output(str(results), b'{"new": 1}\n')
    assert results.read_text() == '{"new": 1}\n'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results.jsonl"]


def test_dash_reads_stdin_and_writes_stdout(
    monkeypatch: pytest.MonkeyPatch, capsysbinary: pytest.CaptureFixture[bytes]
) -> None:
    import io

    from kvflow.cli import run_batch

    stdin = io.TextIOWrapper(io.BytesIO(b'{"a": 1}\n\n  \n{"b": 2}\n'))
    monkeypatch.setattr(run_batch.sys, "stdin", stdin)
    assert run_batch.read_lines("-") == [b'{"a": 1}', b'{"b": 2}']  # blank lines skipped
    run_batch.write_output("-", b'{"c": 3}\n')
    assert capsysbinary.readouterr().out == b'{"c": 3}\n'


def test_every_line_is_admitted_before_the_first_step(
    llm: LLM, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_step = llm.engine.step_deltas
    admitted: list[int] = []

    def recording_step() -> Any:
        admitted.append(len(llm.engine.outputs.request_ids()))
        return real_step()

    monkeypatch.setattr(llm.engine, "step_deltas", recording_step)
    two_prompts = _line("two", "/v1/completions", {"prompt": PROMPTS, "n": 2, **_greedy()})
    lines = [line.encode() for line in [*_batch_lines(), two_prompts]]
    run_file(llm, lines, str(tmp_path / "results.jsonl"))
    # 4 good lines + a line of 2 prompts (its own tasks, a loop turn later): one batch
    assert admitted[0] == 6
    records = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    choices = records[-1]["response"]["body"]["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
