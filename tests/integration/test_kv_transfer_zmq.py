"""The zmq connector in process: a consumer engine pulls each prompt's KV from a
producer engine's block server. Greedy outputs equal a colocated engine's, the
consumer computes one prompt token per sample, and a producer that is not there costs
a recompute (or fails the request, by policy) without leaking a block."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

import pytest

from kvflow import LLM, SamplingParams
from kvflow.kv_transfer.scheduler.connector import KVConnectorScheduler
from kvflow.kv_transfer.scheduler.step_feature import KVTransferFeature
from kvflow.proto.sampling import KVTransferParams

pytestmark = pytest.mark.slow

PROMPTS = [
    "The quick brown fox jumps over the lazy dog. " * 6,
    "Hello",
    "One two three four five six seven eight nine ten eleven twelve thirteen fourteen",
]
NUM_BLOCKS = 64


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _llm(model: Path, role: str | None, port: int = 0, **options: Any) -> LLM:
    kv = None
    if role is not None:
        extra = {"kv_port": port} if role == "kv_producer" else {}
        kv = {"kv_role": role, "kv_connector": "zmq", "kv_connector_extra_config": extra}
    return LLM(
        str(model),
        dtype="float32",
        device="cpu",
        num_threads=1,
        num_blocks=NUM_BLOCKS,
        block_size=8,
        kv_transfer_config=kv,
        **options,
    )


def _params(remote: str | None) -> list[SamplingParams]:
    kv = KVTransferParams(remote_address=remote) if remote else None
    return [
        SamplingParams(max_tokens=12, temperature=0.0, kv_transfer_params=kv),
        SamplingParams(max_tokens=8, temperature=0.0, n=2, kv_transfer_params=kv),
        SamplingParams(max_tokens=12, temperature=0.0, stop=[" the"], kv_transfer_params=kv),
    ]


def _texts(llm: LLM, params: list[SamplingParams]) -> list[list[str]]:
    return [[c.text for c in o.outputs] for o in llm.generate(PROMPTS, params)]


def _no_leaks(llm: LLM) -> None:
    kv_cache = llm.engine.kv_cache
    kv_cache.check_integrity()
    assert kv_cache.num_free_blocks == NUM_BLOCKS


def test_consumer_pulls_from_producer(tiny_model_dir: Path) -> None:
    expected = _texts(_llm(tiny_model_dir, None), _params(None))
    port = _free_port()
    producer = _llm(tiny_model_dir, "kv_producer", port)
    producer.generate(PROMPTS, SamplingParams(max_tokens=1, temperature=0.0))
    consumer = _llm(tiny_model_dir, "kv_consumer")
    assert _texts(consumer, _params(f"tcp://127.0.0.1:{port}")) == expected
    counters = _connector(consumer).counters
    assert counters.num_computed_prompt_tokens == 4  # one per sample ("Hello": its only one)
    assert counters.bytes_loaded > 0 and counters.num_load_failures == 0
    _no_leaks(producer)
    _no_leaks(consumer)


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_producer_gone(tiny_model_dir: Path, policy: str) -> None:
    expected = _texts(_llm(tiny_model_dir, None), _params(None))
    consumer = _llm(
        tiny_model_dir, "kv_consumer", kv_load_timeout=0.3, kv_load_failure_policy=policy
    )
    nobody = f"tcp://127.0.0.1:{_free_port()}"
    outputs = consumer.generate(PROMPTS, _params(nobody))
    if policy == "recompute":
        assert [[c.text for c in o.outputs] for o in outputs] == expected
    else:  # "Hello" has nothing to load: it runs; the others fail
        reasons = [[c.finish_reason for c in o.outputs] for o in outputs]
        assert reasons[0] == ["error"] and reasons[2] == ["error"]
        assert [c.text for c in outputs[1].outputs] == expected[1]
    counters = _connector(consumer).counters
    assert counters.num_load_failures == 2
    _no_leaks(consumer)


def _connector(llm: LLM) -> KVConnectorScheduler:
    feature = llm.engine.scheduler.feature(KVTransferFeature)
    assert feature is not None
    return feature.connector
