"""The KV-poisoning attack on a decode instance, and why it fails now.

The attack: a decode instance (zmq kv_consumer) pulls a prompt's KV from whatever
`kv_transfer_params.remote_address` names. A client names a fake producer that answers
every pull with garbage blocks of the right shape; those blocks land in the prefix
cache, and the next client sending the same prompt gets an answer computed on garbage.

Now the consumer honours a remote address only as the proxy signed it under the cluster
secret: the client's own, and one signed with another key, get a 400 (counted), the fake
producer is never asked, and the next request is exact."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import numpy as np
import pytest
import zmq
from serve_harness import (
    MODEL_NAME,
    Server,
    free_port,
    metric_values,
    signed_kv_params,
    start_server,
    stop_server,
)

from kvflow import LLM, SamplingParams
from kvflow.cluster_secret import ClusterSecret
from kvflow.proto.kv_transfer import KVBlocksHeader, KVPull

pytestmark = pytest.mark.slow

BLOCK_SIZE = 8
PROMPT = "Once upon a time in a land far away there lived a careful engineer. " * 3


class FakeProducer:
    """The attacker's 20 lines: answers every KVPull with random blocks of the tiny
    model's layout ([layers, K/V, block_size, kv_heads, head_dim], float32)."""

    def __init__(self, model_dir: Path) -> None:
        config = json.loads((model_dir / "config.json").read_text())
        self.shape = [config["num_hidden_layers"], 2, BLOCK_SIZE]
        self.shape += [config["num_key_value_heads"], config["head_dim"]]
        self.address = f"tcp://127.0.0.1:{free_port()}"
        self.pulls = 0
        self._context: zmq.Context[Any] = zmq.Context()
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.bind(self.address)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self._socket.poll(50):
                continue
            peer, payload = self._socket.recv_multipart()
            pull = msgspec.msgpack.decode(payload, type=KVPull)
            self.pulls += 1
            header = KVBlocksHeader(pull.req_id, pull.keys, "float32", self.shape)
            garbage = [np.random.rand(*self.shape).astype("float32") * 100 for _ in pull.keys]
            self._socket.send_multipart([peer, msgspec.msgpack.encode(header), *garbage])

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self._socket.close(linger=0)
        self._context.term()


@pytest.fixture
def consumer(tiny_model_dir: Path, tmp_path: Path) -> Iterator[Server]:
    kv = {"kv_role": "kv_consumer", "kv_connector": "zmq", "kv_connector_extra_config": {}}
    server = start_server(
        tiny_model_dir,
        tmp_path,
        "--num-threads",
        "1",
        "--block-size",
        str(BLOCK_SIZE),
        "--kv-transfer-config",
        json.dumps(kv),
        "--kv-load-timeout",
        "2",
    )
    yield server
    stop_server(server)


def _complete(server: Server, **extra: Any) -> httpx.Response:
    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 8, "temperature": 0.0}
    return httpx.post(server.base_url + "/v1/completions", json={**body, **extra}, timeout=60.0)


def test_a_client_cannot_poison_the_cache_through_kv_transfer_params(
    consumer: Server, tiny_model_dir: Path
) -> None:
    fake = FakeProducer(tiny_model_dir)
    try:
        attacks = [
            {"remote_address": fake.address},  # the demo: unsigned
            signed_kv_params(fake.address, ClusterSecret(b"attacker's own key 32 bytes long")),
            {**signed_kv_params(fake.address), "remote_address": "tcp://127.0.0.1:1"},
        ]
        for params in attacks:
            for _ in range(2):  # the demo repeated it: every repeat is refused
                answer = _complete(consumer, kv_transfer_params=params)
                assert answer.status_code == 400, answer.text
                assert answer.json()["error"]["param"] == "kv_transfer_params"
        assert fake.pulls == 0  # the consumer never asked the fake producer
    finally:
        fake.close()
    victim = _complete(consumer)
    assert victim.status_code == 200, victim.text
    llm = LLM(str(tiny_model_dir), dtype="float32", device="cpu", num_threads=1, num_blocks=64)
    expected = llm.generate(PROMPT, SamplingParams(max_tokens=8, temperature=0.0))
    assert victim.json()["choices"][0]["text"] == expected[0].outputs[0].text
    usage = victim.json()["usage"]
    assert (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0) == 0
    values = metric_values(consumer.base_url)
    assert values["kvflow:kv_transfer_params_rejected_total"] == 6
    assert values.get("kvflow:kv_transfer_loaded_bytes_total", 0) == 0
