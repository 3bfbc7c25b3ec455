"""The tokenizer of an engine started with `skip_tokenizer_init`: token ids in and out.

A model directory without tokenizer files (a config.json benchmarked with random
weights, a pipeline that tokenizes elsewhere) still serves prompts given as token ids;
outputs carry their token ids and empty text. Anything that needs text (a text prompt,
a chat template, stop strings) is refused with InvalidRequestError, the HTTP 400 of the
server, naming the flag.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kvflow.errors import InvalidRequestError

NEEDS_TOKENIZER = (
    "this engine runs without a tokenizer (skip_tokenizer_init / --skip-tokenizer-init): "
    "send prompts as token ids"
)


class TokenIdsOnly:
    """Stands where the HF tokenizer stands; decoding gives "" (no text to give)."""

    all_special_ids: list[int] = []
    all_special_tokens: list[str] = []
    chat_template = None
    bos_token_id = None

    def __init__(self, model_dir: Path) -> None:
        config = json.loads((model_dir / "config.json").read_text())
        eos = config.get("eos_token_id")
        self.eos_token_id: int | None = eos[0] if isinstance(eos, list) and eos else eos
        self.vocab_size = int(config.get("vocab_size", 0))

    def __len__(self) -> int:
        return self.vocab_size

    def encode(self, text: str, *args: Any, **kwargs: Any) -> list[int]:
        raise InvalidRequestError(NEEDS_TOKENIZER, param="prompt")

    def __call__(self, text: Any, *args: Any, **kwargs: Any) -> Any:
        raise InvalidRequestError(NEEDS_TOKENIZER, param="prompt")

    def apply_chat_template(self, *args: Any, **kwargs: Any) -> Any:
        raise InvalidRequestError(NEEDS_TOKENIZER + " (no chat template)", param="messages")

    def decode(self, ids: Any, *args: Any, **kwargs: Any) -> str:
        return ""

    def convert_ids_to_tokens(self, ids: Any, *args: Any, **kwargs: Any) -> Any:
        return "" if isinstance(ids, int) else ["" for _ in ids]

    def get_vocab(self) -> dict[str, int]:
        return {}
