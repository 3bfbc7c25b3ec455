"""`kvflow generate` and `kvflow chat` for real (subprocesses on the tiny model), and the
README's promise about the native CPU kernels: without a C++ compiler, or with
KVFLOW_CPU_KERNELS=0, kvflow logs why and runs plain torch, with the same answers.

Every run is compared with the in-process engine's greedy reply to the same chat
prompt. The subprocesses take other kernel routes than this process (native C++ or
torch, different summation orders in float32), so equal tokens need greedy choices far
from ties: the tiny model's logits are peaky (initializer_range 0.2), and
`expected_reply` checks that every step's winner leads the runner-up by more than 1e-3
in logprob, about a thousand times what the routes differ by in float32.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
from serve_harness import KVFLOW

from kvflow import LLM, SamplingParams
from kvflow.tokenizer import apply_chat_template

pytestmark = pytest.mark.slow

MAX_TOKENS = 12
ENGINE_FLAGS = ["--dtype", "float32", "--device", "cpu", "--num-blocks", "64"]
MIN_MARGIN = 1e-3


@pytest.fixture(scope="module")
def offline(tiny_model_dir: Path) -> LLM:
    return LLM(str(tiny_model_dir), dtype="float32", device="cpu", num_blocks=64)


def expected_reply(llm: LLM, conversation: list[dict[str, str]]) -> str:
    """The engine's greedy reply (the CLI's defaults: temperature 0, EOS stops)."""
    prompt = apply_chat_template(llm.tokenizer, conversation)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=2)
    completion = llm.generate([prompt], params)[0].outputs[0]
    for step in completion.logprobs or []:
        best, second = sorted((lp.logprob for lp in step.values()), reverse=True)[:2]
        assert best - second > MIN_MARGIN, (conversation, best, second)
    return completion.text


def run_cli(
    model_dir: Path, args: list[str], env: dict[str, str], stdin: str = ""
) -> subprocess.CompletedProcess[str]:
    command = [str(KVFLOW), "--log-level", "info", *args, "--model", str(model_dir)]
    command += [*ENGINE_FLAGS, "--max-tokens", str(MAX_TOKENS)]
    result = subprocess.run(
        command, input=stdin, capture_output=True, text=True, env=env, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def test_generate_streams_the_reply(tiny_model_dir: Path, offline: LLM) -> None:
    question = "Write a haiku about GPUs"
    result = run_cli(tiny_model_dir, ["generate", question], dict(os.environ))
    assert result.stdout == expected_reply(offline, [{"role": "user", "content": question}]) + "\n"


def test_generate_with_two_tensor_parallel_ranks(tiny_model_dir: Path, offline: LLM) -> None:
    # README, "Tensor and pipeline parallelism": `--tensor-parallel-size 2` (two ranks).
    question = "Write a haiku about TPUs"
    flags = ["generate", question, "--tensor-parallel-size", "2", "--num-threads", "1"]
    result = run_cli(tiny_model_dir, flags, dict(os.environ))
    assert "rank 1 of 2 joined tcp://127.0.0.1:" in result.stderr
    assert result.stdout == expected_reply(offline, [{"role": "user", "content": question}]) + "\n"


def test_generate_with_two_pipeline_stages(tiny_model_dir: Path, offline: LLM) -> None:
    # README, "Tensor and pipeline parallelism": `--pipeline-parallel-size 2` (a layer each).
    question = "Write a haiku about pipelines"
    flags = ["generate", question, "--pipeline-parallel-size", "2", "--num-threads", "1"]
    result = run_cli(tiny_model_dir, flags, dict(os.environ))
    assert "rank 1 of 2 joined tcp://127.0.0.1:" in result.stderr
    assert result.stdout == expected_reply(offline, [{"role": "user", "content": question}]) + "\n"


def test_generate_without_a_compiler_falls_back_to_torch(
    tiny_model_dir: Path, offline: LLM, tmp_path: Path
) -> None:
    # native_build looks for $CXX (default g++), then c++, on PATH: leave it none.
    env = {k: v for k, v in os.environ.items() if k != "CXX"}
    env["PATH"] = str(tmp_path)  # an empty folder; kvflow itself is named by full path
    question = "Name a prime number"
    result = run_cli(tiny_model_dir, ["generate", question], env)
    assert "no C++ compiler found: native CPU kernels off" in result.stderr
    assert result.stdout == expected_reply(offline, [{"role": "user", "content": question}]) + "\n"


def test_chat_reads_turns_from_stdin_with_kernels_off(tiny_model_dir: Path, offline: LLM) -> None:
    env = {**os.environ, "KVFLOW_CPU_KERNELS": "0"}
    turns = ["Hello there", "Tell me more"]
    result = run_cli(tiny_model_dir, ["chat"], env, stdin="\n".join(turns) + "\n\n")
    assert "native CPU kernels off (KVFLOW_CPU_KERNELS=0)" in result.stderr
    banner, *replies = result.stdout.split("> ")
    assert banner.startswith("kvflow chat")
    assert replies[-1] == ""  # the empty line ended the chat at the third prompt
    history: list[Any] = []
    for turn, printed in zip(turns, replies[:-1], strict=True):
        history.append({"role": "user", "content": turn})
        reply = expected_reply(offline, history)  # the whole conversation so far
        assert printed == reply + "\n"
        history.append({"role": "assistant", "content": reply})
