"""`kvflow bench ... --shape NAME`: each preset is the size it claims (counted from its
config on the meta device: no weights), and a shrunken preset of each family runs
`bench throughput --config DIR` with random weights."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from kvflow.bench.shapes import (
    SHAPES,
    apply_shape_args,
    parameter_count,
    shape_config,
    write_shape_dir,
)
from kvflow.cli.main import main

SHRINK = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16,
)  # fmt: skip


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_preset_parameter_count(name: str) -> None:
    count = parameter_count(shape_config(name))
    assert round(count / 1e9, 2) == SHAPES[name].params_b


def test_llama_1b_is_llama_3_2_1b() -> None:
    # Llama-3.2-1B: 1,235,814,400 parameters (tied embeddings counted once).
    assert parameter_count(shape_config("llama-1b")) == 1_235_814_400


def test_moe_preset_routes_8_of_48() -> None:
    config = shape_config("qwen3-moe-1b")
    assert (config.num_experts, config.num_experts_per_tok, config.num_hidden_layers) == (48, 8, 16)


def test_shape_args_select_dummy_weights(tmp_path: Path) -> None:
    path = write_shape_dir("llama-1b", tmp_path, **SHRINK)
    assert (path / "tokenizer.json").is_file()  # text workloads work
    args = argparse.Namespace(shape=None, config=str(path), model=None)
    apply_shape_args(args)
    assert (args.model, args.load_format) == (str(path), "dummy")
    assert not hasattr(args, "skip_tokenizer_init")
    (path / "tokenizer.json").unlink()
    (path / "tokenizer_config.json").unlink()
    args = argparse.Namespace(shape=None, config=str(path), model=None)
    apply_shape_args(args)
    assert args.skip_tokenizer_init  # a bare config.json: token ids only


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(SHAPES))
def test_tiny_preset_runs(name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    extra = {"moe_intermediate_size": 32, "num_experts": 4, "num_experts_per_tok": 2}
    path = write_shape_dir(name, tmp_path, **SHRINK, **(extra if "moe" in name else {}))
    argv = ["bench", "throughput", "--config", str(path), "--num-prompts", "2",
            "--input-len", "8", "--output-len", "4", "--dtype", "float32",
            "--num-threads", "1", "--block-size", "4", "--json"]  # fmt: skip
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (report["kvflow"]["prompt_tokens"], report["kvflow"]["output_tokens"]) == (16, 8)
