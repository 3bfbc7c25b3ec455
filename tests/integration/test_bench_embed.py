"""`kvflow bench embed` on the tiny model: kvflow's embeddings/s, and with `--compare
vllm` the peer's run in another interpreter (here: this one with a stand-in `vllm`
package on its path) gets kvflow's model, dtype, limits and pooler, and its numbers land
in the same report."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from serve_harness import ENGINE_ARGS

pytestmark = pytest.mark.slow

KVFLOW = Path(sys.executable).with_name("kvflow")

FAKE_VLLM = """
import json, os, time
__version__ = "0.0-fake"
class _Embedding:
    def __init__(self): self.embedding = [0.0] * 64
class _Output:
    def __init__(self): self.outputs = _Embedding()
class LLM:
    def __init__(self, **kwargs):
        kwargs["pooler_config"] = vars(kwargs["pooler_config"])
        with open(os.environ["FAKE_VLLM_LOG"], "w") as f:
            json.dump({"kwargs": kwargs, "env": os.environ.get("VLLM_TARGET_DEVICE")}, f)
    def embed(self, prompts, use_tqdm):
        assert all(set(p) == {"prompt_token_ids"} for p in prompts)
        time.sleep(0.2)
        return [_Output() for _ in prompts]
"""
FAKE_CONFIG = """
class PoolerConfig:
    def __init__(self, pooling_type, normalize):
        self.pooling_type, self.normalize = pooling_type, normalize
"""


def test_embed_bench_compared_with_vllm(tiny_model_dir: Path, tmp_path: Path) -> None:
    fake = tmp_path / "fake" / "vllm"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text(FAKE_VLLM)
    (fake / "config.py").write_text(FAKE_CONFIG)
    peer = tmp_path / "peer-python"
    peer.write_text(f'#!/bin/sh\nPYTHONPATH={tmp_path / "fake"} exec {sys.executable} "$@"\n')
    peer.chmod(0o755)
    log = tmp_path / "vllm.json"
    command = [
        str(KVFLOW), "bench", "embed", "--model", str(tiny_model_dir), *ENGINE_ARGS,
        "--num-prompts", "6", "--input-len", "24", "--max-num-batched-tokens", "64",
        "--pooler-config", '{"pooling_type": "MEAN"}',
        "--compare", "vllm", "--peer-python", str(peer), "--json",
    ]  # fmt: skip
    env = {**os.environ, "FAKE_VLLM_LOG": str(log)}
    done = subprocess.run(command, capture_output=True, text=True, timeout=400, env=env)
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    kvflow, peer_result = report["kvflow"], report["vllm 0.0-fake"]
    for result in (kvflow, peer_result):
        assert (result["num_embeddings"], result["prompt_tokens"]) == (6, 6 * 24)
        assert result["embeddings_per_s"] == pytest.approx(6 / result["elapsed_s"], rel=1e-2)
    asked = json.loads(log.read_text())
    assert asked["env"] == "cpu"
    kwargs = asked["kwargs"]
    assert kwargs["model"] == str(tiny_model_dir) and kwargs["runner"] == "pooling"
    assert kwargs["pooler_config"] == {"pooling_type": "MEAN", "normalize": True}
    assert kwargs["max_num_batched_tokens"] == 64 and kwargs["enable_prefix_caching"] is False
    ratio = kvflow["embeddings_per_s"] / peer_result["embeddings_per_s"]
    assert report["speedup_embeddings_per_s"] == pytest.approx(ratio, rel=2e-2, abs=0.01)
