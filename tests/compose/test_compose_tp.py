"""The `tp` profile of compose.yaml: one engine whose model is split over two worker
containers (worker-tp0, worker-tp1), so torch.distributed's rendezvous and gloo's
collectives cross container boundaries. Brought up for real by `make test-compose`
with a tiny random-weight model mounted from the host; its greedy output must equal
the offline TP=1 engine's on the same model (the static checks need no Docker)."""

from __future__ import annotations

import json
import os
import shutil
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from test_compose import (
    COMPOSE_FILE,
    PROJECT,
    REQUEST_TIMEOUT_S,
    UP_TIMEOUT_S,
    compose_command,
    compose_services,
    expected_addresses,
    free_port,
    live,
    print_logs,
    run,
    timed,
)

TP_ROLES = ("worker-tp0", "worker-tp1", "scheduler-tp", "detokenizer-tp", "frontend-tp")
RENDEZVOUS = "tcp://worker-tp0:29500"
PROMPT = "The capital of France is"
MAX_TOKENS = 8


def _flag(command: list[str], name: str) -> str:
    return command[command.index(name) + 1]


def test_the_tp_engine_has_an_address_table_of_its_own() -> None:
    services = compose_services()
    tp = {
        k: v.replace("scheduler:", "scheduler-tp:").replace("detokenizer:", "detokenizer-tp:")
        for k, v in expected_addresses().items()
    }
    for role in TP_ROLES:
        assert services[role]["environment"] == tp, role
        assert services[role]["profiles"] == ["tp"], role


def test_every_tp_role_gets_the_same_engine_flags() -> None:
    """World size, model and dtype must agree: the scheduler waits for T subscribers, and
    two ranks that picked different dtypes could not all-reduce."""
    services = compose_services()
    for role in TP_ROLES:
        command = services[role]["command"]
        assert _flag(command, "--tensor-parallel-size") == "2", role
        assert _flag(command, "--model") == "/models/tp", role
        assert _flag(command, "--dtype") == "${KVFLOW_TP_DTYPE:-float32}", role
        assert services[role]["volumes"] == ["${KVFLOW_TP_MODEL_DIR:-./models/tp}:/models/tp:ro"]


def test_the_ranks_meet_at_rank_0s_container() -> None:
    services = compose_services()
    for rank in (0, 1):
        command = services[f"worker-tp{rank}"]["command"]
        assert command[command.index("worker") :][:3] == ["worker", "--rank", str(rank)]
        assert _flag(command, "--distributed-init-method") == RENDEZVOUS
    depends = services["scheduler-tp"]["depends_on"]
    assert set(depends) == {"worker-tp0", "worker-tp1"}
    assert services["frontend-tp"]["ports"] == ["127.0.0.1:${KVFLOW_TP_HTTP_PORT:-8003}:8000"]


def _readable_copy(source: Path, dest: Path) -> Path:
    """The model as the containers' user (uid 10001) can read it through the mount."""
    shutil.copytree(source, dest)
    for path in [dest, *dest.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    return dest


@dataclass
class TpStack:
    api: str
    compose: list[str]
    env: dict[str, str]

    def logs(self, service: str) -> str:
        return run([*self.compose, "logs", "--no-color", service], self.env, 120).stdout

    def kill(self, service: str) -> None:
        """SIGKILL the service's main process from the host: a crash, which the restart
        policy answers (`docker kill` would count as a manual stop)."""
        container = run([*self.compose, "ps", "-q", service], self.env, 60).stdout.strip()
        pid = run(["docker", "inspect", "-f", "{{.State.Pid}}", container], self.env, 60)
        os.kill(int(pid.stdout.strip()), 9)


@pytest.fixture(scope="module")
def tp_stack(tiny_model_dir: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TpStack]:
    model = _readable_copy(tiny_model_dir("llama"), tmp_path_factory.mktemp("tp") / "model")
    port = free_port()
    env = {**os.environ, "KVFLOW_TP_HTTP_PORT": str(port), "KVFLOW_TP_MODEL_DIR": str(model)}
    env |= {"KVFLOW_HTTP_PORT": str(free_port()), "KVFLOW_PROMETHEUS_PORT": str(free_port())}
    compose = [*compose_command(), "-f", str(COMPOSE_FILE), "-p", PROJECT, "--profile", "tp"]
    run([*compose, "down", "-v", "--remove-orphans", "--timeout", "10"], env, timeout=180)
    start = time.monotonic()
    wait = ["--wait", "--wait-timeout", str(UP_TIMEOUT_S)]
    up = run([*compose, "up", "-d", *wait, "frontend-tp"], env, 1200)
    timed("tp profile up -d --wait", start)
    try:
        if up.returncode != 0:
            print_logs(compose, env)
            pytest.fail(f"compose up (tp) failed:\n{up.stdout}{up.stderr}")
        yield TpStack(f"http://127.0.0.1:{port}", compose, env)
    finally:
        down = run([*compose, "down", "-v", "--remove-orphans", "--timeout", "30"], env, 300)
        assert down.returncode == 0, down.stderr


def _complete(api: str, max_tokens: int = MAX_TOKENS) -> dict[str, Any]:
    body = {"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}
    request = urllib.request.Request(
        api + "/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as response:
        return dict(json.load(response))


@live
def test_two_rank_containers_serve_what_one_rank_computes(
    tp_stack: TpStack, tiny_model_dir: Any
) -> None:
    from kvflow import LLM, SamplingParams

    for rank in (0, 1):  # each container joined the one group at rank 0's container
        assert f"rank {rank} of 2 joined {RENDEZVOUS} (gloo)" in tp_stack.logs(f"worker-tp{rank}")
    start = time.monotonic()
    reply = _complete(tp_stack.api)
    timed("one completion over TP=2 containers", start)
    assert reply["usage"]["completion_tokens"] == MAX_TOKENS, reply
    llm = LLM(str(tiny_model_dir("llama")), dtype="float32", num_threads=1, num_blocks=256)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    (reference,) = llm.generate([PROMPT], params)
    assert reply["choices"][0]["text"] == reference.outputs[0].text


@live
def test_a_killed_rank_brings_the_group_back_and_the_stream_resumes(
    tp_stack: TpStack, tiny_model_dir: Any
) -> None:
    """Rank 1's container crashes mid-stream: rank 0's next collective fails, so it exits
    too, Docker restarts both, they meet again at the rendezvous, and the scheduler
    resumes the request on the new group: the stream runs to its full length."""
    import openai

    client = openai.OpenAI(base_url=tp_stack.api + "/v1", api_key="-", timeout=REQUEST_TIMEOUT_S)
    (model,) = client.models.list().data
    request = {"model": model.id, "prompt": PROMPT, "max_tokens": 40, "temperature": 0.0}
    request |= {"extra_body": {"ignore_eos": True}}
    reference = client.completions.create(**request).choices[0].text
    pieces: list[str] = []
    finishes: list[str] = []
    usage = None
    start = time.monotonic()
    stream = client.completions.create(
        **request, stream=True, stream_options={"include_usage": True}
    )
    for chunk in stream:
        pieces.extend(choice.text for choice in chunk.choices)
        finishes.extend(c.finish_reason for c in chunk.choices if c.finish_reason)
        usage = chunk.usage or usage
        if len(pieces) == 4:
            tp_stack.kill("worker-tp1")
            start = time.monotonic()
    timed("stream finished after rank 1's SIGKILL", start)
    assert finishes == ["length"] and usage is not None and usage.completion_tokens == 40
    # float32 and peaky logits: the resumed (recomputed) tokens are the uncrashed ones.
    assert "".join(pieces) == reference
