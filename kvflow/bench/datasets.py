"""Request sets of `kvflow bench serve`: random, sharegpt, prefix_repetition (vLLM's names).

Prompt construction: `random` and `prefix_repetition` build prompts as *token ids* from a
seed and send them as token-id prompts (the OpenAI completions API accepts a list of ids;
kvflow, vLLM and SGLang serve it). Their input lengths are therefore exact: there is no
decode / re-encode round trip whose merges would change the count (vLLM has to re-encode
and truncate its decoded text for that reason). Only the tokenizer's `vocab_size` and
special ids are needed. `sharegpt` sends the conversation's text and counts its tokens
with the local tokenizer, as the server will (special tokens included).

Determinism: the same arguments and seed give the same requests, in the same order.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvflow.bench.throughput import random_token_prompts

# vLLM's sharegpt filter (`is_valid_sequence`): drop tiny and oversized conversations.
SHAREGPT_MIN_LEN = 4
SHAREGPT_MAX_PROMPT_LEN = 1024
SHAREGPT_MAX_TOTAL_LEN = 2048


@dataclass(frozen=True)
class SampleRequest:
    """One benchmark request: `prompt` is text or token ids; `prompt_len` its tokens."""

    prompt: str | list[int]
    prompt_len: int
    expected_output_len: int


@dataclass(frozen=True)
class TokenSpace:
    """Which ids random prompts draw from (see `random_token_prompts`)."""

    vocab_size: int
    special_ids: list[int]


def _seeds(seed: int, count: int) -> list[int]:
    """Independent child seeds, so lengths, tokens and order do not share one stream."""
    return [int(s) for s in np.random.SeedSequence(seed).generate_state(count)]


def range_bounds(length: int, range_ratio: float) -> tuple[int, int]:
    """vLLM's sampling range [X·(1-r), X·(1+r)], inclusive, never below 1 token."""
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {range_ratio}")
    low = max(1, int(length * (1 - range_ratio)))
    return low, max(low, int(length * (1 + range_ratio)))


def sample_random(
    num_requests: int,
    input_len: int,
    output_len: int,
    range_ratio: float,
    prefix_len: int,
    tokens: TokenSpace,
    seed: int,
) -> list[SampleRequest]:
    """`prefix_len` ids shared by every request, then each request's own random ids.

    Input lengths (excluding the prefix) and output lengths are drawn uniformly from
    `range_bounds`; with range_ratio 0 they are exactly input_len and output_len."""
    length_seed, token_seed, prefix_seed = _seeds(seed, 3)
    rng = np.random.default_rng(length_seed)
    in_low, in_high = range_bounds(input_len, range_ratio)
    out_low, out_high = range_bounds(output_len, range_ratio)
    input_lens = rng.integers(in_low, in_high + 1, size=num_requests)
    output_lens = rng.integers(out_low, out_high + 1, size=num_requests)
    bodies = random_token_prompts(
        num_requests, in_high, tokens.vocab_size, tokens.special_ids, token_seed
    )
    prefix: list[int] = []
    if prefix_len > 0:
        prefix = random_token_prompts(
            1, prefix_len, tokens.vocab_size, tokens.special_ids, prefix_seed
        )[0]
    requests = []
    for body, in_len, out_len in zip(bodies, input_lens, output_lens):
        ids = prefix + body[: int(in_len)]
        requests.append(SampleRequest(ids, len(ids), int(out_len)))
    return requests


def sample_prefix_repetition(
    num_requests: int,
    prefix_len: int,
    suffix_len: int,
    num_prefixes: int,
    output_len: int,
    tokens: TokenSpace,
    seed: int,
) -> list[SampleRequest]:
    """`num_prefixes` random prefixes, each shared by every num_prefixes-th request,
    followed by a random suffix of its own; the order is shuffled (prefix-cache test)."""
    if num_prefixes < 1:
        raise ValueError("--prefix-repetition-num-prefixes must be at least 1")
    prefix_seed, suffix_seed, order_seed = _seeds(seed, 3)
    space = (tokens.vocab_size, tokens.special_ids)
    prefixes = random_token_prompts(num_prefixes, prefix_len, *space, prefix_seed)
    suffixes = random_token_prompts(num_requests, suffix_len, *space, suffix_seed)
    requests = [
        SampleRequest(prefixes[i % num_prefixes] + suffix, prefix_len + suffix_len, output_len)
        for i, suffix in enumerate(suffixes)
    ]
    order = np.random.default_rng(order_seed).permutation(num_requests)
    return [requests[int(i)] for i in order]


def load_sharegpt(path: Path) -> list[tuple[str, str]]:
    """(first human turn, first reply) of every conversation with at least two turns."""
    entries = json.loads(Path(path).read_text(encoding="utf-8"))
    if not isinstance(entries, list):
        raise ValueError(f"{path}: expected a JSON list of sharegpt conversations")
    pairs = []
    for entry in entries:
        turns = entry.get("conversations") if isinstance(entry, dict) else None
        if isinstance(turns, list) and len(turns) >= 2:
            pairs.append((str(turns[0]["value"]), str(turns[1]["value"])))
    return pairs


def sample_sharegpt(
    pairs: list[tuple[str, str]],
    num_requests: int,
    count_tokens: Callable[[str, bool], int],
    seed: int,
    output_len: int | None = None,
) -> list[SampleRequest]:
    """Shuffled conversations kept by vLLM's length filter; output length is the reply's
    token count unless `output_len` fixes it. Too few valid ones are cycled through.

    `count_tokens(text, add_special_tokens)`: the prompt counts as the server sees it
    (with BOS), the reply without special tokens (it is generated, not encoded)."""
    order = np.random.default_rng(seed).permutation(len(pairs))
    samples: list[SampleRequest] = []
    for index in order:
        if len(samples) == num_requests:
            break
        prompt, reply = pairs[int(index)]
        prompt_len = count_tokens(prompt, True)
        out_len = count_tokens(reply, False) if output_len is None else output_len
        if _valid_sharegpt(prompt_len, out_len, check_output=output_len is None):
            samples.append(SampleRequest(prompt, prompt_len, out_len))
    if not samples:
        raise ValueError("no sharegpt conversation passed the length filter")
    return [samples[i % len(samples)] for i in range(num_requests)]


def _valid_sharegpt(prompt_len: int, output_len: int, check_output: bool) -> bool:
    too_short = prompt_len < SHAREGPT_MIN_LEN or (check_output and output_len < SHAREGPT_MIN_LEN)
    too_long = (
        prompt_len > SHAREGPT_MAX_PROMPT_LEN or prompt_len + output_len > SHAREGPT_MAX_TOTAL_LEN
    )
    return not (too_short or too_long)
