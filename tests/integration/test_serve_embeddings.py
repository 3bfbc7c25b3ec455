"""`kvflow serve --runner pooling`: /v1/embeddings through the `openai` client, /pooling,
the 4xx cases, and `kvflow run-batch`'s /v1/embeddings lines, against transformers.

The served model is the tiny random Llama dressed as a sentence-transformers model:
`modules.json` names a MEAN pooling module and a Normalize module, and config.json
lists Matryoshka dimensions, so the server's pooler comes from those files. Vectors
are checked against transformers' last hidden states (float32), mean-pooled and
normalised, within 1e-4 cosine distance. A budget of 16 tokens a step splits the
longer inputs over several steps.
"""

from __future__ import annotations

import base64
import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch
from serve_harness import MODEL_NAME, Server, start_server, stop_server

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.slow

TEXTS = ["The quick brown fox jumps over the lazy dog " * 3, "hello", "Embeddings for search"]
MATRYOSHKA = [16, 32]
FLAGS = ["--runner", "pooling", "--max-num-batched-tokens", "16", "--max-model-len", "64"]


@pytest.fixture(scope="module")
def st_model_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    target = tmp_path_factory.mktemp("st-model") / "model"
    shutil.copytree(tiny_model_dir, target)
    config = json.loads((target / "config.json").read_text())
    config["matryoshka_dimensions"] = MATRYOSHKA
    (target / "config.json").write_text(json.dumps(config))
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
    ]  # fmt: skip
    (target / "modules.json").write_text(json.dumps(modules))
    (target / "1_Pooling").mkdir()
    pooling = {"word_embedding_dimension": 64, "pooling_mode_mean_tokens": True,
               "pooling_mode_cls_token": False, "pooling_mode_lasttoken": False}  # fmt: skip
    (target / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    return target


@pytest.fixture(scope="module")
def server(st_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = start_server(st_model_dir, tmp_path_factory.mktemp("serve"), *FLAGS)
    yield srv
    code, survivors = stop_server(srv)
    assert survivors == [] and code == 0, srv.log_tail()


@pytest.fixture(scope="module")
def client(server: Server) -> Any:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0)


@pytest.fixture(scope="module")
def reference(st_model_dir: Path) -> Any:
    """ids -> transformers' mean of the last hidden states (not normalised)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(st_model_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(st_model_dir)

    def mean(item: str | list[int]) -> np.ndarray:
        ids = tokenizer.encode(item) if isinstance(item, str) else item
        with torch.no_grad():
            out = model(torch.tensor([ids]), output_hidden_states=True)
        return out.hidden_states[-1][0].mean(0).numpy()  # type: ignore[no-any-return]

    mean.tokenizer = tokenizer  # type: ignore[attr-defined]
    return mean


def _cosine_distance(a: Any, b: np.ndarray) -> float:
    a = np.asarray(a, dtype=np.float64)
    return float(1 - a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def test_embeddings_float_base64_and_token_ids(client: Any, reference: Any) -> None:
    result = client.embeddings.create(model=MODEL_NAME, input=TEXTS, encoding_format="float")
    assert [d.index for d in result.data] == [0, 1, 2]
    ids = [reference.tokenizer.encode(t) for t in TEXTS]
    assert len(ids[0]) > 16  # spans several steps
    assert result.usage.prompt_tokens == result.usage.total_tokens == sum(map(len, ids))
    for item, text in zip(result.data, TEXTS):
        assert len(item.embedding) == 64
        assert abs(np.linalg.norm(item.embedding) - 1) < 1e-5  # the Normalize module
        assert _cosine_distance(item.embedding, reference(text)) < 1e-4
    encoded = client.embeddings.create(model=MODEL_NAME, input=ids, encoding_format="base64")
    for item, floats in zip(encoded.data, result.data):
        decoded = np.frombuffer(base64.b64decode(item.embedding), dtype="<f4")
        assert np.allclose(decoded, floats.embedding, atol=1e-6)
    # Without a format the client asks for base64 and decodes it itself.
    default = client.embeddings.create(model=MODEL_NAME, input=TEXTS)
    for item, floats in zip(default.data, result.data):
        assert np.allclose(item.embedding, floats.embedding, atol=1e-6)
    single = client.embeddings.create(model=MODEL_NAME, input=ids[1])
    assert np.allclose(single.data[0].embedding, result.data[1].embedding, atol=1e-6)


def test_matryoshka_dimensions(client: Any, reference: Any) -> None:
    result = client.embeddings.create(model=MODEL_NAME, input="hello", dimensions=16)
    vector = result.data[0].embedding
    assert len(vector) == 16 and abs(np.linalg.norm(vector) - 1) < 1e-5
    assert _cosine_distance(vector, reference("hello")[:16]) < 1e-4
    with pytest.raises(openai.BadRequestError, match="Matryoshka dimensions"):
        client.embeddings.create(model=MODEL_NAME, input="hello", dimensions=20)


def test_pooling_route_in_vllms_shape(server: Server, client: Any) -> None:
    body = {"model": MODEL_NAME, "input": ["hello", "Embeddings for search"]}
    reply = httpx.post(server.base_url + "/pooling", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    payload = reply.json()
    assert payload["object"] == "list" and payload["id"].startswith("pool-")
    assert [d["object"] for d in payload["data"]] == ["pooling", "pooling"]
    expected = client.embeddings.create(model=MODEL_NAME, input=body["input"]).data
    for item, embedding in zip(payload["data"], expected):
        assert np.allclose(item["data"], embedding.embedding, atol=1e-6)
    raw = httpx.post(server.base_url + "/pooling", json={**body, "encoding_format": "base64"})
    decoded = np.frombuffer(base64.b64decode(raw.json()["data"][0]["data"]), dtype="<f4")
    assert np.allclose(decoded, payload["data"][0]["data"], atol=1e-6)


@pytest.mark.parametrize(
    ("path", "body", "message"),
    [
        ("/v1/completions", {"prompt": "hi"}, "pooling runner"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, "pooling"),
        ("/v1/responses", {"input": "hi"}, "pooling runner"),
        ("/v1/embeddings", {"input": ""}, "input"),
        ("/v1/embeddings", {"input": []}, "input"),
        ("/v1/embeddings", {"input": [1, "a"]}, "not a mix"),
        ("/v1/embeddings", {"input": "word " * 80}, "context is 64 tokens"),
        ("/pooling", {"input": [[5] * 65]}, "context is 64 tokens"),
        ("/v1/embeddings", {"input": "hi", "encoding_format": "int8"}, "encoding_format"),
        ("/v1/embeddings", {"input": "hi", "dimensions": 0}, "dimensions"),
        ("/v1/embeddings", {"input": [10**9]}, "vocabulary"),
    ],
)
def test_bad_requests_get_a_4xx_in_openai_shape(
    server: Server, path: str, body: dict[str, Any], message: str
) -> None:
    reply = httpx.post(server.base_url + path, json=body, timeout=60)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["type"] == "invalid_request_error" and message in error["message"], error


def test_truncate_prompt_tokens_fits_a_long_input(client: Any, reference: Any) -> None:
    ids = reference.tokenizer.encode("word " * 80)
    result = client.embeddings.create(
        model=MODEL_NAME, input=ids, extra_body={"truncate_prompt_tokens": 64}
    )
    assert result.usage.prompt_tokens == 64  # exactly the context: nothing is generated
    assert _cosine_distance(result.data[0].embedding, reference(ids[-64:])) < 1e-4


def test_run_batch_answers_embeddings_lines(st_model_dir: Path, tmp_path: Path) -> None:
    from kvflow import LLM
    from kvflow.cli.run_batch import run_file

    def line(custom_id: str, url: str, body: dict[str, Any]) -> bytes:
        record = {"custom_id": custom_id, "method": "POST", "url": url, "body": body}
        return json.dumps(record).encode()

    lines = [
        line("e-0", "/v1/embeddings", {"input": TEXTS}),
        line("cmpl", "/v1/completions", {"prompt": "hi"}),
        line("e-1", "/v1/embeddings", {"input": "hello", "encoding_format": "base64"}),
    ]
    llm = LLM(str(st_model_dir), dtype="float32", device="cpu", runner="pooling", num_blocks=64)
    try:
        run_file(llm, lines, str(tmp_path / "out.jsonl"))
        expected = [o.outputs.embedding for o in llm.embed(TEXTS)]
    finally:
        llm.close()
    records = [json.loads(r) for r in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [r["custom_id"] for r in records] == ["e-0", "cmpl", "e-1"]
    body = records[0]["response"]["body"]
    assert body["object"] == "list" and body["usage"]["prompt_tokens"] > 0
    for item, vector in zip(body["data"], expected):
        assert np.allclose(item["embedding"], vector, atol=1e-6)
    assert records[1]["error"]["code"] == 400 and "pooling" in records[1]["error"]["message"]
    decoded = np.frombuffer(
        base64.b64decode(records[2]["response"]["body"]["data"][0]["embedding"]), "<f4"
    )
    assert np.allclose(decoded, expected[1], atol=1e-6)
