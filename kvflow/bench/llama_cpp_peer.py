"""`kvflow bench throughput --compare llama.cpp`: llama.cpp runs the same workload on the
same model shapes, as BF16 and as Q8_0 GGUFs, in the same invocation.

    config.json ─▶ dummy_checkpoint.py (random safetensors, once)
                ─▶ conversion_view (a Qwen2 checkpoint read as the Llama it equals)
                ─▶ llama.cpp's convert_hf_to_gguf.py --outtype bf16 | q8_0 (once each)
                ─▶ llama-batched-bench: --num-prompts sequences of --input-len prompt
                   tokens, all prefilled, then --output-len decode steps of them all

llama.cpp is the one of /work/shared/peers (its README): the source vendored in the
llama-cpp-python sdist under `$PEERS_WORK/llamacpp-src`, built with cmake into
`$PEERS_WORK/llama-server-build` (`$PEERS_WORK` defaults to ~/.cache/kvflow-peers;
`$KVFLOW_LLAMA_CPP_SRC` / `$KVFLOW_LLAMA_CPP_BUILD` point elsewhere). A missing
llama-batched-bench is built there first (`-DGGML_NATIVE=ON`, AMX off: the peers'
settings for this CPU). Its timing is kvflow's: wall time of prefill + decode of the
whole batch; output tok/s = sequences x output tokens / that time.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvflow.errors import ConfigError

OUTTYPES = ("bf16", "q8_0")  # the GGUFs compared, as convert_hf_to_gguf.py names them
SDIST = "llama_cpp_python-0.3.36"  # the peers' llama.cpp (commit 0c1e570)
CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=OFF", "-DGGML_NATIVE=ON",
    "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF",
    "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_TOOLS=ON",
    "-DLLAMA_OPENSSL=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_BUILD_UI=OFF",
)  # fmt: skip
BUILD_TIMEOUT_S = 3600.0
RUN_TIMEOUT_S = 3600.0


@dataclass(frozen=True)
class LlamaCpp:
    source: Path  # llama.cpp's source tree (convert_hf_to_gguf.py, gguf-py)
    build: Path  # its cmake build directory

    @classmethod
    def locate(cls) -> LlamaCpp:
        work = Path(os.environ.get("PEERS_WORK", "~/.cache/kvflow-peers")).expanduser()
        default_source = work / "llamacpp-src" / SDIST / "vendor" / "llama.cpp"
        source = Path(os.environ.get("KVFLOW_LLAMA_CPP_SRC", default_source)).expanduser()
        build = os.environ.get("KVFLOW_LLAMA_CPP_BUILD", str(work / "llama-server-build"))
        if not (source / "convert_hf_to_gguf.py").is_file():
            raise ConfigError(
                f"--compare llama.cpp needs llama.cpp's source at {source} (unpack the "
                f"{SDIST} sdist there, see /work/shared/peers/README.md, or set "
                "KVFLOW_LLAMA_CPP_SRC)"
            )
        return cls(source, Path(build).expanduser())

    def tool(self, name: str) -> Path:
        return self.build / "bin" / name

    def build_commands(self, target: str) -> list[list[str]]:
        configure = ["cmake", "-S", str(self.source), "-B", str(self.build), "-G", "Ninja"]
        jobs = str(len(os.sched_getaffinity(0)))
        build = ["cmake", "--build", str(self.build), "--target", target, "-j", jobs]
        return [configure + list(CMAKE_FLAGS), build]

    def convert_command(self, checkpoint: Path, gguf: Path, outtype: str) -> list[str]:
        script = self.source / "convert_hf_to_gguf.py"
        return [sys.executable, str(script), str(checkpoint), "--outfile", str(gguf),
                "--outtype", outtype]  # fmt: skip

    def convert_env(self) -> dict[str, str]:
        """The converter's own gguf-py (newer than a released gguf) first on the path."""
        path = [str(self.source / "gguf-py"), os.environ.get("PYTHONPATH", "")]
        return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in path if p)}


@dataclass(frozen=True)
class Workload:
    num_prompts: int
    input_len: int
    output_len: int
    threads: int


def batched_bench_command(llama: LlamaCpp, gguf: Path, work: Workload) -> list[str]:
    """One batch: every sequence's prompt prefilled (not shared), then output_len steps."""
    context = work.num_prompts * (work.input_len + work.output_len) + 16
    return [
        str(llama.tool("llama-batched-bench")), "-m", str(gguf),
        "-c", str(context), "-b", "2048", "-ub", "512", "-ngl", "0",
        "-t", str(work.threads), "-tb", str(work.threads),
        "-npp", str(work.input_len), "-ntg", str(work.output_len), "-npl", str(work.num_prompts),
        "--output-format", "jsonl",
    ]  # fmt: skip


def parse_batched_bench(stdout: str) -> dict[str, Any]:
    """The result row llama-batched-bench prints as JSON (one per -npl value)."""
    rows = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    if not rows:
        raise RuntimeError(f"llama-batched-bench printed no result:\n{stdout[-2000:]}")
    return dict(rows[-1])


def _run(command: list[str], timeout: float, env: dict[str, str] | None = None) -> str:
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=timeout, env=env, check=False
    )
    if done.returncode != 0:
        tail = (done.stderr + done.stdout)[-3000:]
        raise RuntimeError(f"{Path(command[0]).name} failed (exit {done.returncode}):\n{tail}")
    return done.stdout


def ensure_built(llama: LlamaCpp, target: str = "llama-batched-bench") -> None:
    if llama.tool(target).is_file():
        return
    print(f"building llama.cpp's {target} in {llama.build} (once; minutes)", file=sys.stderr)
    for command in llama.build_commands(target):
        _run(command, BUILD_TIMEOUT_S)


def ensure_ggufs(llama: LlamaCpp, model_dir: Path, work_dir: Path) -> dict[str, Path]:
    """The model as a random-weight checkpoint, then as a GGUF of each OUTTYPES."""
    from kvflow.bench.dummy_checkpoint import write_dummy_checkpoint

    checkpoint = conversion_view(write_dummy_checkpoint(model_dir, work_dir / "checkpoint"))
    ggufs = {}
    for outtype in OUTTYPES:
        gguf = work_dir / f"model-{outtype}.gguf"
        if not gguf.is_file():
            partial = gguf.with_name(gguf.name + ".partial")
            _run(llama.convert_command(checkpoint, partial, outtype), RUN_TIMEOUT_S,
                 llama.convert_env())  # fmt: skip
            partial.rename(gguf)
        ggufs[outtype] = gguf
    return ggufs


# Model types converted as the Llama architecture they equal. llama.cpp's converter names
# a Qwen2 checkpoint's BPE pre-tokenizer by hashing what the tokenizer transformers picks
# for that model type (Qwen2Tokenizer) makes of a test text, and the shape directories'
# embedded tokenizer read that way is not one it knows; a Qwen2 model is a Llama with
# q/k/v biases, which llama.cpp's llama graph adds where the GGUF has them.
AS_LLAMA = {"qwen2"}


def conversion_view(checkpoint: Path) -> Path:
    """The directory convert_hf_to_gguf.py reads: `checkpoint` itself, or for AS_LLAMA
    model types a sibling with its files linked and a config that says Llama."""
    config = json.loads((checkpoint / "config.json").read_text())
    if config.get("model_type") not in AS_LLAMA:
        return checkpoint
    view = checkpoint.with_name(checkpoint.name + "-as-llama")
    view.mkdir(exist_ok=True)
    for source in checkpoint.iterdir():
        if source.name != "config.json" and not (view / source.name).exists():
            (view / source.name).symlink_to(source.resolve())
    llama = config | {"model_type": "llama", "architectures": ["LlamaForCausalLM"]}
    (view / "config.json").write_text(json.dumps(llama | {"attention_bias": True}, indent=1))
    return view


def work_dir_for(model_dir: Path) -> Path:
    """Where a model's checkpoint and GGUFs are kept (by its config's content)."""
    import hashlib

    from kvflow.cache_dir import default_cache_dir

    digest = hashlib.sha256((model_dir / "config.json").read_bytes()).hexdigest()[:16]
    return default_cache_dir() / "bench" / "llama-cpp" / digest


def run_llama_cpp(model_dir: Path, work: Workload) -> dict[str, dict[str, Any]]:
    """llama-batched-bench's row for each GGUF type, by "llama.cpp BF16" etc."""
    llama = LlamaCpp.locate()
    ensure_built(llama)
    ggufs = ensure_ggufs(llama, model_dir, work_dir_for(model_dir))
    results = {}
    for outtype, gguf in ggufs.items():
        stdout = _run(batched_bench_command(llama, gguf, work), RUN_TIMEOUT_S)
        results[f"llama.cpp {outtype.upper()}"] = parse_batched_bench(stdout)
    return results
