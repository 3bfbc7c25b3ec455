"""Real-size model shapes for `kvflow bench ... --shape NAME` / `--config DIR`.

A benchmark of a 1B model needs its shapes, not its weights: the preset's config.json
is written (with the embedded model's tokenizer, so text workloads work) to
`<cache>/bench/shape-NAME` and the engine loads it with `--load-format dummy` (random
weights, gpu_worker/dummy_weights.py). `--config DIR` does the same for any directory
holding a config.json (a tokenizer is optional: without one, prompts are token ids).

The parameter count of a preset is computed from its config on torch's meta device
(shapes only, no memory), and the tests hold each preset to its stated size.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Shape:
    config_class: str  # a transformers config class
    architecture: str
    fields: dict[str, Any]
    params_b: float  # the stated size in billions (rounded to 2 decimals)


SHAPES: dict[str, Shape] = {
    # Llama-3.2-1B: 16 layers, hidden 2048, 32 heads / 8 KV heads, MLP 8192, tied.
    "llama-1b": Shape(
        "LlamaConfig", "LlamaForCausalLM",
        dict(
            hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
            num_attention_heads=32, num_key_value_heads=8, head_dim=64, vocab_size=128256,
            tie_word_embeddings=True, rope_theta=500000.0, rms_norm_eps=1e-5,
            max_position_embeddings=131072,
        ),
        1.24,
    ),
    # Qwen2.5-3B's published config.json (q/k/v biases are Qwen2's own).
    "qwen2.5-3b": Shape(
        "Qwen2Config", "Qwen2ForCausalLM",
        dict(
            hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
            num_attention_heads=16, num_key_value_heads=2, vocab_size=151936,
            tie_word_embeddings=True, rope_theta=1000000.0, rms_norm_eps=1e-6,
            max_position_embeddings=32768, use_sliding_window=False,
        ),
        3.09,
    ),
    # A Qwen3-MoE of ~1B parameters: 48 experts, top-8, 16 layers, expert width 384
    # (the config of docs/benchmarks.md's first MoE figures), the embedded tokenizer's
    # vocabulary (text prompts cover all of it).
    "qwen3-moe-1b": Shape(
        "Qwen3MoeConfig", "Qwen3MoeForCausalLM",
        dict(
            hidden_size=1024, intermediate_size=3072, moe_intermediate_size=384,
            num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=4, head_dim=128,
            num_experts=48, num_experts_per_tok=8, decoder_sparse_step=1, norm_topk_prob=True,
            vocab_size=49152, tie_word_embeddings=True, rope_theta=1000000.0,
            rms_norm_eps=1e-6, max_position_embeddings=32768,
        ),
        1.04,
    ),
    # SmolLM2-135M (the embedded model's shape): a draft model's size for the 1B shape
    # (`kvflow bench spec-decode --draft-shape smollm2-135m` gives it the target's vocab).
    "smollm2-135m": Shape(
        "LlamaConfig", "LlamaForCausalLM",
        dict(
            hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
            num_attention_heads=9, num_key_value_heads=3, head_dim=64, vocab_size=49152,
            tie_word_embeddings=True, rope_theta=100000.0, rms_norm_eps=1e-5,
            max_position_embeddings=8192,
        ),
        0.13,
    ),
}  # fmt: skip


def shape_config(name: str, **overrides: Any) -> Any:
    """The transformers config of preset `name` (fields overridable: tests shrink it)."""
    import transformers

    shape = SHAPES[name]
    config = getattr(transformers, shape.config_class)(**{**shape.fields, **overrides})
    config.architectures = [shape.architecture]
    return config


def parameter_count(config: Any) -> int:
    """Parameters of the model `config` describes (tied weights once), counted on the
    meta device: no weight is allocated."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


def write_shape_dir(name: str, root: Path | None = None, **overrides: Any) -> Path:
    """config.json of preset `name` + the embedded tokenizer, written once."""
    from kvflow.cache_dir import default_cache_dir

    suffix = "-".join(f"{k}{v}" for k, v in sorted(overrides.items()))
    path = (root or default_cache_dir() / "bench") / f"shape-{name}{'-' + suffix if suffix else ''}"
    if not (path / "config.json").exists():
        from transformers import AutoTokenizer

        from kvflow.gpu_worker.model_files import resolve_model_dir

        AutoTokenizer.from_pretrained(str(resolve_model_dir(None))).save_pretrained(path)
        shape_config(name, **overrides).save_pretrained(path)
    return path


def add_shape_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_mutually_exclusive_group()
    group.add_argument(
        "--shape", choices=sorted(SHAPES), default=None,
        help="a built-in real-size model shape with random weights (--load-format dummy)",
    )  # fmt: skip
    group.add_argument(
        "--config", default=None, metavar="DIR",
        help="a directory with a config.json: its shapes with random weights (--load-format dummy)",
    )  # fmt: skip


def shape_model_dir(args: argparse.Namespace) -> Path | None:
    """The model directory `--shape`/`--config` names, or None when neither is given."""
    if getattr(args, "shape", None):
        return write_shape_dir(args.shape)
    if getattr(args, "config", None):
        path = Path(args.config).expanduser()
        if not (path / "config.json").is_file():
            raise SystemExit(f"--config {path}: no config.json there")
        return path
    return None


def apply_shape_args(args: argparse.Namespace) -> None:
    """`--shape`/`--config` become the engine's --model with --load-format dummy."""
    path = shape_model_dir(args)
    if path is None:
        return
    if getattr(args, "model", None) is not None:
        raise SystemExit("--shape/--config replace --model: give one of them")
    args.model = str(path)
    args.load_format = "dummy"
    if not (path / "tokenizer.json").exists() and not (path / "tokenizer_config.json").exists():
        args.skip_tokenizer_init = True  # a bare config: token ids in and out


def add_args(parser: argparse.ArgumentParser) -> None:
    """`kvflow bench shape NAME`: write the preset's directory, print its path."""
    parser.add_argument("name", choices=sorted(SHAPES))
    parser.add_argument("--count", action="store_true", help="also print the parameter count")


def run(args: argparse.Namespace) -> int:
    path = write_shape_dir(args.name)
    if args.count:
        print(f"{parameter_count(shape_config(args.name)) / 1e9:.3f}B parameters")
    print(path)
    return 0
