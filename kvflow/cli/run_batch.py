"""`kvflow run-batch`: an OpenAI batch file (JSONL) answered offline by one engine.

Input line:  {"custom_id", "method": "POST", "url": "/v1/completions" | "/v1/chat/completions"
              | "/v1/embeddings" (an engine with --runner pooling), "body": {...}}
Output line: {"id": "batch_req_...", "custom_id", "response": {"status_code", "request_id",
              "body": <the server's response>}, "error": null}
         or: {"id", "custom_id", "response": null, "error": {"code": <HTTP status>, "message"}}

Bodies go through the server's own handlers (parse, validate, chat template, response
types; services/frontend/serving_*.py) over an in-process engine (batch_engine.py), all
lines at once so they batch. A bad line becomes an error record; a failing engine step
ends the run. The output follows input order and is written atomically (a temp file in
the same directory, fsync, rename): an interrupted run leaves the previous file as it was.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import msgspec
from tqdm import tqdm

from kvflow.cli.args import add_engine_args, engine_options

if TYPE_CHECKING:
    from starlette.responses import Response

    from kvflow.cli.batch_engine import OfflineEngineClient
    from kvflow.services.frontend.serving_common import ServingContext


class Answerable(Protocol):
    """A validated request of any endpoint: its id and its whole response."""

    id: str

    async def full(self) -> Response: ...


Prepare = Callable[["ServingContext", bytes, dict[str, str]], "tuple[Answerable, bool]"]


class BatchLine(msgspec.Struct):
    custom_id: str
    method: str
    url: str
    body: msgspec.Raw  # parsed by the endpoint's own request type


class BatchResponse(msgspec.Struct):
    status_code: int
    request_id: str
    body: msgspec.Raw


class BatchError(msgspec.Struct):
    code: int  # the HTTP status the server would have answered
    message: str


class BatchOutput(msgspec.Struct):
    id: str
    custom_id: str | None
    response: BatchResponse | None
    error: BatchError | None


class LineError(Exception):
    """A line the batch format itself rejects (before any endpoint sees its body)."""


def add_run_batch_parser(sub: Any) -> None:
    parser = sub.add_parser("run-batch", help="answer an OpenAI batch file (JSONL) offline")
    parser.add_argument(
        "-i", "--input-file", required=True, help="requests, one JSON a line ('-': stdin)"
    )
    parser.add_argument("-o", "--output-file", required=True, help="results ('-': stdout)")
    add_engine_args(parser)
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from kvflow.offline.llm import LLM

    lines = read_lines(args.input_file)  # before the model loads: a wrong path fails at once
    llm = LLM(**engine_options(args))
    try:
        run_file(llm, lines, args.output_file)
    finally:
        llm.close()
    return 0


def read_lines(path: str) -> list[bytes]:
    """The file's non-blank lines ('-': stdin)."""
    data = sys.stdin.buffer.read() if path == "-" else Path(path).read_bytes()
    return [line for line in data.splitlines() if line.strip()]


def run_file(llm: Any, lines: list[bytes], output_file: str) -> None:
    """Answer every line with `llm`'s engine; write `output_file` whole once all are
    answered (nothing, if the run fails)."""
    results = run_lines(llm, lines)
    write_output(output_file, b"".join(result + b"\n" for result in results))


def run_lines(llm: Any, lines: list[bytes]) -> list[bytes]:
    """The output line of each input line, in order."""
    return asyncio.run(_run_lines(llm, lines))


async def _run_lines(llm: Any, lines: list[bytes]) -> list[bytes]:
    from kvflow.cli.batch_engine import OfflineEngineClient

    client = OfflineEngineClient(llm.engine)
    ctx = _serving_context(llm.engine, client)
    progress = tqdm(total=len(lines), desc="batch", unit="line")
    tasks = [asyncio.create_task(_answer(ctx, line)) for line in lines]
    for task in tasks:
        task.add_done_callback(lambda _: progress.update(1))
    try:
        await client.run_until_done(tasks)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        progress.close()
    return [task.result() for task in tasks]


def _serving_context(engine: Any, client: OfflineEngineClient) -> ServingContext:
    from kvflow.services.frontend.kv_params import KVParamsGate
    from kvflow.services.frontend.metrics import FrontendMetrics
    from kvflow.services.frontend.serving_common import ServingContext
    from kvflow.services.launch.launcher import ServeOptions, make_frontend_config

    config = make_frontend_config(engine.config, engine.model_dir, ServeOptions())
    metrics = FrontendMetrics(config.served_model_name, config.max_model_len)
    # No proxy signs for an offline batch: a line's remote kv_transfer_params are refused.
    kv_params = KVParamsGate(None, metrics.count_kv_params_rejected)
    return ServingContext(config, client, engine.tokenizer, metrics, kv_params)


async def _answer(ctx: ServingContext, raw_line: bytes) -> bytes:
    """One output line; every failure of the line is its error record."""
    from kvflow.services.frontend.errors import error_info

    custom_id = _custom_id(raw_line)
    try:
        line = msgspec.json.decode(raw_line, type=BatchLine)
        prepare = _endpoint(line)
    except (LineError, msgspec.DecodeError) as exc:  # the line's own shape, not its body
        return _encode(custom_id, None, BatchError(400, f"invalid batch line: {exc}"))
    try:
        served, _ = prepare(ctx, bytes(line.body), {})  # a streaming body is answered whole
        response = await served.full()
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # as the server answers it: 400 for a bad body, ...
        status, info = error_info(exc)
        return _encode(custom_id, None, BatchError(status, info.message))
    body = BatchResponse(response.status_code, served.id, msgspec.Raw(response.body))
    return _encode(custom_id, body, None)


def _endpoint(line: BatchLine) -> Prepare:
    from kvflow.services.frontend.serving_chat import prepare_chat_completion
    from kvflow.services.frontend.serving_completions import prepare_completion
    from kvflow.services.frontend.serving_embeddings import prepare_embedding

    if line.method.upper() != "POST":
        raise LineError(f"method must be POST, got {line.method!r}")
    if line.url == "/v1/completions":
        return prepare_completion
    if line.url == "/v1/chat/completions":
        return prepare_chat_completion
    if line.url == "/v1/embeddings":  # answered by an engine with --runner pooling
        return prepare_embedding
    raise LineError(
        f"unknown url {line.url!r}: run-batch serves /v1/completions, /v1/chat/completions "
        "and /v1/embeddings"
    )


def _custom_id(raw_line: bytes) -> str | None:
    """The line's custom_id if it has one, so that even a bad line can be matched."""
    try:
        value = json.loads(raw_line).get("custom_id")
    except (ValueError, AttributeError):
        return None
    return value if isinstance(value, str) else None


def _encode(
    custom_id: str | None, response: BatchResponse | None, error: BatchError | None
) -> bytes:
    output = BatchOutput(f"batch_req_{uuid.uuid4().hex}", custom_id, response, error)
    return msgspec.json.encode(output)


def write_output(path: str, data: bytes) -> None:
    """Write `data` whole or not at all: temp file beside `path`, fsync, rename."""
    if path == "-":
        sys.stdout.buffer.write(data)
        sys.stdout.flush()
        return
    target = Path(path)
    fd, temp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as file:
            file.write(data)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temp, target)
    except BaseException:
        Path(temp).unlink(missing_ok=True)
        raise
