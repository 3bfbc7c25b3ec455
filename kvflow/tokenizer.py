"""Tokenizer loading, EOS ids and chat templates (shared by the offline API and frontend)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from kvflow.errors import InvalidRequestError
from kvflow.token_ids_only import TokenIdsOnly

Conversation = list[dict[str, Any]]
# apply_chat_template's own arguments: a request's template kwargs may not set them.
_OWN_ARGUMENTS = frozenset(
    {"conversation", "messages", "tools", "tokenize", "add_generation_prompt", "tokenizer"}
)


def load_tokenizer(model_dir: Path, skip: bool = False) -> Any:
    """The model's HF tokenizer, from disk only (never the hub); `skip`
    (skip_tokenizer_init): none, token ids in and out (kvflow/token_ids_only.py)."""
    if skip:
        return TokenIdsOnly(model_dir)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


def load_decoding_tokenizer(model_dir: Path, skip: bool = False) -> Any:
    """A tokenizer for processes that only decode or read EOS ids (scheduler, worker,
    detokenizer, bench client).

    `AutoTokenizer` takes ~20 s on a busy 2-core machine because its model registry
    imports torch; the generic fast class loads from `tokenizer.json` in ~3 s. Decoding is
    the same Rust backend and the special tokens come from the same tokenizer_config.json.
    """
    if skip or not (model_dir / "tokenizer.json").is_file():
        return load_tokenizer(model_dir, skip)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(str(model_dir))


def has_tokenizer_files(model_dir: Path) -> bool:
    """Whether the directory holds a tokenizer (a GGUF's is converted into it)."""
    names = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
    return any((model_dir / name).is_file() for name in names)


def _generation_config_eos(model_dir: Path) -> set[int]:
    """eos_token_id of generation_config.json (an int or a list), if any."""
    path = model_dir / "generation_config.json"
    if not path.exists():
        return set()
    eos = json.loads(path.read_text()).get("eos_token_id")
    if isinstance(eos, int):
        return {eos}
    return {int(e) for e in eos} if isinstance(eos, list) else set()


def load_eos_token_ids(model_dir: Path, tokenizer: Any) -> frozenset[int]:
    """EOS ids from generation_config.json plus the tokenizer's own."""
    ids = _generation_config_eos(model_dir)
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return frozenset(ids)


def read_eos_token_ids(model_dir: Path) -> frozenset[int]:
    """`load_eos_token_ids` without transformers, for processes that need only the ids
    (worker, scheduler): the `tokenizers` library reads tokenizer.json in milliseconds,
    where importing transformers takes seconds of start-up."""
    config_path = model_dir / "tokenizer_config.json"
    if not has_tokenizer_files(model_dir):  # skip_tokenizer_init: the config's own
        return load_eos_token_ids(model_dir, TokenIdsOnly(model_dir))
    if not (model_dir / "tokenizer.json").is_file() or not config_path.is_file():
        return load_eos_token_ids(model_dir, load_decoding_tokenizer(model_dir))
    from tokenizers import Tokenizer

    ids = _generation_config_eos(model_dir)
    eos = json.loads(config_path.read_text()).get("eos_token")
    if isinstance(eos, dict):  # an AddedToken serialised as {"content": ...}
        eos = eos.get("content")
    if eos:
        eos_id = Tokenizer.from_file(str(model_dir / "tokenizer.json")).token_to_id(eos)
        if eos_id is not None:
            ids.add(int(eos_id))
    return frozenset(ids)


def apply_chat_template(
    tokenizer: Any,
    messages: Conversation,
    add_generation_prompt: bool = True,
    tools: list[dict[str, Any]] | None = None,  # for templates that render tools
    template_kwargs: dict[str, Any] | None = None,  # e.g. {"enable_thinking": False}
) -> list[int]:
    """Render a conversation with the model's template and tokenize it.

    `template_kwargs` become template variables (a request's `chat_template_kwargs`);
    they cannot replace the arguments this function itself passes."""
    if isinstance(tokenizer, TokenIdsOnly):  # skip_tokenizer_init: no template either
        tokenizer.apply_chat_template(messages)  # raises, naming the flag
    if not tokenizer.chat_template:
        raise InvalidRequestError("this model has no chat template; use completions instead")
    for message in messages:
        if not isinstance(message, dict) or "role" not in message:
            raise InvalidRequestError("each message needs a 'role' and 'content'", param="messages")
    extra = {k: v for k, v in (template_kwargs or {}).items() if k not in _OWN_ARGUMENTS}
    text = tokenizer.apply_chat_template(
        messages,
        tools=tools,
        tokenize=False,
        add_generation_prompt=add_generation_prompt,
        **extra,
    )
    # The template already wrote BOS etc.; adding special tokens again would double them.
    return list(tokenizer.encode(text, add_special_tokens=False))
