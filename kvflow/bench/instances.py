"""Local kvflow processes for a benchmark: `kvflow serve` / `kvflow proxy` on 127.0.0.1.

Each runs in a session of its own (stopped as a group: its engine processes too), may be
pinned to a set of CPUs (`os.sched_setaffinity` before exec: every process the server
spawns inherits it), and logs to a file whose tail a failed start reports.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import httpx

STOP_TIMEOUT_S = 30.0


@dataclass
class Instance:
    name: str
    process: subprocess.Popen[bytes]
    base_url: str
    log_path: Path
    log: IO[bytes]

    def log_tail(self, chars: int = 4000) -> str:
        self.log.flush()
        return self.log_path.read_text(errors="replace")[-chars:]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def launch(name: str, args: list[str], log_dir: Path, cpus: list[int] | None) -> Instance:
    """`kvflow <args> --port <free>` (args start with "serve" or "proxy")."""
    port = free_port()
    command = [sys.executable, "-m", "kvflow.cli.main", *args, "--port", str(port)]
    return launch_command(name, command, port, log_dir, cpus)


def launch_command(
    name: str,
    command: list[str],
    port: int,
    log_dir: Path,
    cpus: list[int] | None = None,
    env: dict[str, str] | None = None,
) -> Instance:
    """Any server process listening on 127.0.0.1:`port` (e.g. a peer engine's)."""
    log_path = log_dir / f"{name}.log"
    # Open for the instance's lifetime: stop() closes it.
    log = open(log_path, "wb")  # noqa: SIM115

    def pin() -> None:  # in the child, before exec: no threads exist there yet
        if cpus is not None:
            os.sched_setaffinity(0, cpus)

    process = subprocess.Popen(
        command,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        preexec_fn=pin,
        env=env,
    )
    return Instance(name, process, f"http://127.0.0.1:{port}", log_path, log)


def wait_healthy(instance: Instance, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if instance.process.poll() is not None:
            raise RuntimeError(
                f"{instance.name} exited with {instance.process.returncode}:\n{instance.log_tail()}"
            )
        try:
            if httpx.get(instance.base_url + "/health", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass  # not listening yet
        time.sleep(0.1)
    raise RuntimeError(f"{instance.name} not healthy in {timeout_s:.0f} s:\n{instance.log_tail()}")


def stop(instance: Instance) -> None:
    """SIGTERM to the instance's process group, SIGKILL after STOP_TIMEOUT_S."""
    with contextlib.suppress(ProcessLookupError):  # the group may be gone already
        os.killpg(instance.process.pid, signal.SIGTERM)
    try:
        instance.process.wait(STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(instance.process.pid, signal.SIGKILL)
        instance.process.wait()
    instance.log.close()
