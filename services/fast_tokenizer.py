"""A tokenizer for the processes that only decode or read EOS ids (scheduler,
detokenizer, worker): transformers' generic fast tokenizer straight from
`tokenizer.json`.

`AutoTokenizer` takes ~20 s on a busy 2-core machine because its model registry imports
torch; the generic class loads in ~3 s without it. Text is the same either way: decoding
is the Rust backend's, and the special tokens come from the same `tokenizer_config.json`.
A model without a `tokenizer.json` falls back to `kvflow.tokenizer.load_tokenizer`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any


def load_decoding_tokenizer(model_dir: Path) -> Any:
    if not (model_dir / "tokenizer.json").is_file():
        from kvflow.tokenizer import load_tokenizer

        return load_tokenizer(model_dir)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # read by huggingface_hub on import
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(str(model_dir))


def load_eos_token_ids(model_dir: Path) -> frozenset[int]:
    """The model's EOS ids, as `kvflow.tokenizer.load_eos_token_ids` defines them."""
    from kvflow.tokenizer import load_eos_token_ids as eos_ids

    return eos_ids(model_dir, load_decoding_tokenizer(model_dir))
