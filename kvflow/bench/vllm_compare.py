"""`kvflow bench throughput --compare vllm`: vLLM runs the same prompts, in its own
virtual environment, in the same invocation.

vLLM pins its own torch and cannot share kvflow's environment, so its run is a child
process of the peer's interpreter (`--peer-python`, else `$KVFLOW_VLLM_PYTHON`, else
`~/.cache/kvflow-peers/venv-vllm/bin/python`) executing kvflow/bench/vllm_peer.py,
with the job as JSON on stdin and the result as a marked JSON line on stdout. The model
is the directory kvflow loaded (a GGUF is compared through the same converted weights),
in kvflow's dtype, with kvflow's batch limits, and on CPU with as many OpenMP threads
bound as kvflow's run used.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
from pathlib import Path
from typing import Any

from kvflow.errors import ConfigError

PEER_SCRIPT = Path(__file__).with_name("vllm_peer.py")
EMBED_PEER_SCRIPT = Path(__file__).with_name("vllm_embed_peer.py")  # `kvflow bench embed`
DEFAULT_PYTHON = Path("~/.cache/kvflow-peers/venv-vllm/bin/python")
TIMEOUT_S = 3600.0
RESULT_MARK = "kvflow-peer-result: "  # vllm_peer.py's result line (vLLM logs to stdout too)


def add_peer_python_arg(parser: argparse.ArgumentParser) -> None:
    """`--peer-python`, which every `--compare vllm` bench takes (see `peer_python`)."""
    parser.add_argument(
        "--peer-python",
        default=None,
        help="--compare vllm: the python of vLLM's virtual environment "
        "(default $KVFLOW_VLLM_PYTHON, else ~/.cache/kvflow-peers/venv-vllm/bin/python)",
    )


def peer_python(explicit: str | None) -> Path:
    """The interpreter of vLLM's environment; ConfigError naming where it was looked for."""
    candidate = explicit or os.environ.get("KVFLOW_VLLM_PYTHON") or str(DEFAULT_PYTHON)
    path = Path(candidate).expanduser()
    if not path.exists():
        raise ConfigError(
            f"--compare vllm needs vLLM's environment: no interpreter at {path} "
            "(install vLLM in a virtual environment and pass --peer-python, "
            "see docs/benchmarks.md)"
        )
    return path


def peer_env(device: str, num_threads: int | None) -> dict[str, str]:
    """vLLM's CPU settings: the KV space in GiB and the cores its OpenMP threads bind."""
    env = dict(os.environ)
    if device == "cpu":
        threads = num_threads or len(os.sched_getaffinity(0))
        env.setdefault("VLLM_TARGET_DEVICE", "cpu")
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{threads - 1}")
    return env


def run_vllm(
    python: Path, job: dict[str, Any], env: dict[str, str], script: Path = PEER_SCRIPT
) -> dict[str, Any]:
    """Run a peer script; its result, or RuntimeError with the end of its output."""
    process = subprocess.run(
        # -P: the script's folder is not put on sys.path (its neighbours would shadow
        # modules of the same name, e.g. transformers importing `kernels`).
        [str(python), "-P", str(script)],
        input=json.dumps(job),
        capture_output=True,
        text=True,
        env=env,
        timeout=TIMEOUT_S,
        check=False,
    )
    marked = [
        line[len(RESULT_MARK) :]
        for line in process.stdout.splitlines()
        if line.startswith(RESULT_MARK)
    ]
    if process.returncode != 0 or not marked:
        tail = (process.stderr + process.stdout)[-3000:]
        raise RuntimeError(f"vLLM's run failed (exit {process.returncode}):\n{tail}")
    result: dict[str, Any] = json.loads(marked[-1])
    return result
