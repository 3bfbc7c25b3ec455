"""Loading gpt-oss checkpoints: a missing or misshapen tensor fails at start naming it; a
quantization other than MXFP4 is refused naming it; an MXFP4 checkpoint (the published
format: `_blocks` + `_scales` per expert projection) is dequantized at load to exactly
what transformers' own dequantization gives; and two tensor-parallel ranks (the experts
split either way) give the single-process logits, biases and sinks included."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_gpt_oss import gpt_oss_config, sharpen_gpt_oss
from transformers import AutoModelForCausalLM

from kvflow.errors import UnsupportedModelError
from kvflow.gpu_worker.model_loader import load_model
from kvflow.gpu_worker.mxfp4 import Mxfp4Pairs, dequantize

PROMPT = [5, 17, 42, 8, 90, 3, 77, 21, 60, 11, 33]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(gpt_oss_config())
    sharpen_gpt_oss(model, seed=1)
    path = tmp_path_factory.mktemp("gpt-oss-load")
    model.save_pretrained(path)
    return path


def _variant(source: Path, target: Path, tensors: dict[str, torch.Tensor], **config: Any) -> Path:
    save_file(tensors, target / "model.safetensors", metadata={"format": "pt"})
    raw = json.loads((source / "config.json").read_text())
    (target / "config.json").write_text(json.dumps({**raw, **config}))
    return target


def _load(path: Path) -> torch.nn.Module:
    return load_model(path, torch.float32, torch.device("cpu"), "torch")


def _logits(model: torch.nn.Module, prefill_logits: Any) -> torch.Tensor:
    return prefill_logits(model, PROMPT)


@pytest.mark.parametrize(
    "name",
    ["model.layers.1.mlp.experts.down_proj_bias", "model.layers.0.self_attn.sinks",
     "model.layers.0.mlp.router.bias", "model.layers.1.mlp.experts.gate_up_proj"],
)  # fmt: skip
def test_a_missing_tensor_fails_naming_it(checkpoint: Path, tmp_path: Path, name: str) -> None:
    tensors = load_file(checkpoint / "model.safetensors")
    del tensors[name]
    path = _variant(checkpoint, tmp_path, tensors)
    leaf = name.rsplit(".", 1)[1]
    with pytest.raises(UnsupportedModelError, match=f"lacks tensors.*{leaf}"):
        _load(path)


@pytest.mark.parametrize(
    "name",
    ["model.layers.0.mlp.experts.gate_up_proj", "model.layers.1.self_attn.sinks",
     "model.layers.1.self_attn.q_proj.weight"],
)  # fmt: skip
def test_a_misshapen_tensor_fails_naming_it(checkpoint: Path, tmp_path: Path, name: str) -> None:
    tensors = load_file(checkpoint / "model.safetensors")
    tensors[name] = tensors[name][..., :-2].contiguous()
    with pytest.raises(UnsupportedModelError, match=name.replace(".", r"\.")):
        _load(_variant(checkpoint, tmp_path, tensors))


def test_an_unknown_quantization_is_refused_naming_it(checkpoint: Path, tmp_path: Path) -> None:
    tensors = load_file(checkpoint / "model.safetensors")
    path = _variant(checkpoint, tmp_path, tensors, quantization_config={"quant_method": "gptq"})
    with pytest.raises(UnsupportedModelError, match="gptq"):
        _load(path)


def _random_mxfp4(shape: tuple[int, ...], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(blocks, scales) of an [E, out, in] tensor: random codes, scales near 2^-3."""
    experts, rows, columns = shape
    gen = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (experts, rows, columns // 32, 16), generator=gen)
    scales = torch.randint(122, 126, (experts, rows, columns // 32), generator=gen)
    return blocks.to(torch.uint8), scales.to(torch.uint8)


def test_dequantize_matches_transformers() -> None:
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    blocks, scales = _random_mxfp4((3, 10, 64), seed=0)
    expected = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [E, in, out]
    torch.testing.assert_close(
        dequantize(blocks, scales, torch.float32).transpose(1, 2), expected, rtol=0, atol=0
    )


def test_pairs_are_matched_in_either_order() -> None:
    blocks, scales = _random_mxfp4((2, 4, 32), seed=1)
    expected = dequantize(blocks, scales, torch.float32).transpose(1, 2)
    for halves in ((("w_blocks", blocks), ("w_scales", scales)),
                   (("w_scales", scales), ("w_blocks", blocks))):  # fmt: skip
        pairs = Mxfp4Pairs()
        assert list(pairs.take(*halves[0], torch.float32)) == []
        ((name, values),) = pairs.take(*halves[1], torch.float32)
        assert name == "w" and torch.equal(values, expected) and not pairs.waiting
    assert next(iter(Mxfp4Pairs().take("w", blocks, torch.float32)))[1] is blocks


def test_an_mxfp4_checkpoint_loads_as_its_dequantized_weights(
    checkpoint: Path, tmp_path: Path, prefill_logits: Any
) -> None:
    """The same model stored twice: expert projections as MXFP4 pairs, and as the float
    tensors transformers dequantizes them to."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    float_tensors = load_file(checkpoint / "model.safetensors")
    quantized = dict(float_tensors)
    for seed, name in enumerate(sorted(n for n in float_tensors if n.endswith("_proj"))):
        experts, columns, rows = float_tensors[name].shape  # [E, in, out]
        blocks, scales = _random_mxfp4((experts, rows, columns), seed)
        float_tensors[name] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
        del quantized[name]
        quantized[f"{name}_blocks"], quantized[f"{name}_scales"] = blocks, scales
    (tmp_path / "float").mkdir()
    (tmp_path / "mxfp4").mkdir()
    plain = _load(_variant(checkpoint, tmp_path / "float", float_tensors))
    mxfp4 = _load(
        _variant(checkpoint, tmp_path / "mxfp4", quantized,
                 quantization_config={"quant_method": "mxfp4"})
    )  # fmt: skip
    for a, b in zip(plain.parameters(), mxfp4.parameters(), strict=True):
        assert torch.equal(a, b)
    in_bf16 = load_model(tmp_path / "mxfp4", torch.bfloat16, torch.device("cpu"), "torch")
    for a, b in zip(plain.parameters(), in_bf16.parameters(), strict=True):
        assert b.dtype == torch.bfloat16 and torch.equal(a.to(torch.bfloat16), b)
    expected = _logits(plain, prefill_logits)
    assert expected.std() > 0.5
    torch.testing.assert_close(_logits(mxfp4, prefill_logits), expected, rtol=0, atol=0)


@pytest.mark.slow
@pytest.mark.parametrize("expert_parallel", [False, True])
def test_two_ranks_match_one(checkpoint: Path, tmp_path: Path, expert_parallel: bool) -> None:
    """Sinks split by head, down biases added once (rank 0 under the TP split, the owner
    of the expert under expert parallelism)."""
    import torch.multiprocessing as mp
    from test_moe_parallel import _prefill, _rank

    model_dir = tmp_path / "model"
    shutil.copytree(checkpoint, model_dir)
    expected = _prefill(_load(model_dir))
    mp.spawn(_rank, args=(2, model_dir, expert_parallel), nprocs=2, join=True)
    for rank in range(2):
        got = torch.load(model_dir / f"logits-{expert_parallel}-{rank}.pt")
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
