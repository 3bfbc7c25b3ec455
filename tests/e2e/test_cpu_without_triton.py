"""The CPU path never needs Triton: the CPU Docker image ships without it."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

SCRIPT = """
import sys
sys.modules["triton"] = None  # any `import triton` now raises ImportError
from kvflow import LLM, SamplingParams
llm = LLM(sys.argv[1], device="cpu", dtype="float32", num_blocks=64)
out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, ignore_eos=True))
assert len(out[0].token_ids) == 4, out
print("ok")
"""


def test_offline_engine_runs_without_triton(tiny_model_dir: Any) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tiny_model_dir("llama"))],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]
