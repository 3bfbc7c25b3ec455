"""Roofline estimates of one engine step: FLOPs and bytes moved, from the model's shape
and the step's batch.

A Llama-family decoder step over T scheduled tokens (R of them need logits) costs

    FLOPs = 2·T·L·P                      every matmul weight once per token (P = weights
                                         of one layer: q, k, v, o, gate, up, down)
          + 4·L·nh·d·Σ_i attended_i      QKᵀ and PV: 2·d each per (query, key) pair
          + 2·R·H·V                      LM head, only on the rows that need logits

    attended_i = q_i·c_i - q_i·(q_i-1)/2 (causal: the query at position p sees p+1 keys;
                 request i computes q_i tokens and ends the step with c_i in its KV)

    bytes = w·L·P + b·(2L+1)·H           layer weights and norms, read once per step
          + b·T·H                        embedding rows gathered
          + w·V·H  (if R > 0)            LM head weights
          + b·2·L·nkv·d·Σ_i (c_i + q_i)  KV: each request's context read once, new KV written
          + b·T·L·(7H + 4·nh·d + 2·nkv·d + 3I)  activations: every matmul reads its input
                                         and writes its output once; attention reads q and
                                         writes its output; norms, rotary, residual adds and
                                         the activation function are taken as fused (free)
          + b·R·(H + V)                  LM head input and logits

(H hidden, L layers, nh/nkv query/KV heads, d head dim, I intermediate, V vocab, b bytes
per element of the dtype in use, w bytes per matmul weight: b, or 34/32 under
`--quantization q8_0`: 32 one-byte codes and a half-float scale per block of 32).
Sliding windows, flash re-reads of KV per query tile and sampling are ignored: these are
estimates for a roofline, not a profiler.

A step is *prefill-heavy* when most of its scheduled tokens sit at prompt positions,
else *decode-heavy*; `RooflineMeter` keeps cumulative totals for each.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple, Protocol

from kvflow.proto.stats import PhaseTotals
from kvflow.proto.step import StepPlan

logger = logging.getLogger(__name__)

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# Bytes per matmul weight of a `--quantization` method that fixes them (q8_0's blocks).
# "gguf" keeps each tensor's own block format, so no one figure holds: b is used.
QUANTIZED_WEIGHT_BYTES = {"q8_0": 34 / 32}
PHASES = ("prefill", "decode")


@dataclass(frozen=True)
class ModelShape:
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    dtype_bytes: int
    weight_bytes: float | None = None  # per matmul weight; None: dtype_bytes

    @property
    def matmul_weight_bytes(self) -> float:
        return self.dtype_bytes if self.weight_bytes is None else self.weight_bytes

    @classmethod
    def from_config_dict(
        cls, config: Mapping[str, Any], dtype: str, quantization: str = "none"
    ) -> ModelShape:
        """From an HF config.json's fields (multimodal configs: their `text_config`)."""
        config = config.get("text_config") or config
        hidden = int(config["hidden_size"])
        heads = int(config["num_attention_heads"])
        return cls(
            hidden_size=hidden,
            num_layers=int(config["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or hidden // heads),
            intermediate_size=int(config["intermediate_size"]),
            vocab_size=int(config["vocab_size"]),
            dtype_bytes=DTYPE_BYTES[dtype],
            weight_bytes=QUANTIZED_WEIGHT_BYTES.get(quantization),
        )

    @classmethod
    def from_model_dir(cls, model_dir: Path, dtype: str, quantization: str = "none") -> ModelShape:
        """Reads config.json with `json` alone: the scheduler never imports torch."""
        config = json.loads((model_dir / "config.json").read_text())
        return cls.from_config_dict(config, dtype, quantization)

    @classmethod
    def try_from_model_dir(
        cls, model_dir: Path, dtype: str, quantization: str = "none"
    ) -> ModelShape | None:
        """None (and a warning) for a config without the usual decoder fields."""
        try:
            return cls.from_model_dir(model_dir, dtype, quantization)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            logger.warning("no roofline estimates for %s: %r", model_dir, exc)
            return None

    @property
    def layer_weights(self) -> int:
        """Matmul weights of one decoder layer (q, k, v, o, gate, up, down)."""
        hidden, q_width = self.hidden_size, self.num_heads * self.head_dim
        kv_width = self.num_kv_heads * self.head_dim
        return 2 * hidden * q_width + 2 * hidden * kv_width + 3 * hidden * self.intermediate_size

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes


class ScheduledRequest(Protocol):
    """What the estimate reads of a scheduler request, *after* it was scheduled."""

    @property
    def num_prompt_tokens(self) -> int: ...
    @property
    def num_computed_tokens(self) -> int: ...
    @property
    def num_tokens(self) -> int: ...


@dataclass(frozen=True)
class StepBatch:
    query_lens: list[int]  # tokens computed this step, per request
    context_lens: list[int]  # KV length at the end of the step, per request
    num_logits: int  # rows through the LM head (requests that sample)
    num_prompt_tokens: int  # of the scheduled tokens, those at prompt positions

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens)

    @property
    def num_decode_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def phase(self) -> str:
        return "prefill" if 2 * self.num_prompt_tokens > self.num_tokens else "decode"

    @classmethod
    def from_plan(cls, plan: StepPlan, requests: Mapping[str, ScheduledRequest]) -> StepBatch:
        """The batch of a plan just made (`requests` already count its tokens computed)."""
        scheduled = [requests[req_id] for req_id in plan.scheduled_req_ids]
        return cls.from_scheduled(scheduled, plan.num_scheduled_tokens)

    @classmethod
    def from_scheduled(
        cls, requests: Sequence[ScheduledRequest], query_lens: Sequence[int]
    ) -> StepBatch:
        # List comprehensions: this runs every step, ~0.5 us per request.
        ends = [request.num_computed_tokens for request in requests]
        # A request samples when its chunk reaches the last known token.
        num_logits = sum([end >= r.num_tokens for r, end in zip(requests, ends)])
        # Chunk [end - q, end) holds prompt tokens up to the prompt's end, if it starts before.
        num_prompt = sum(
            [
                min(end, r.num_prompt_tokens) - end + q
                for r, end, q in zip(requests, ends, query_lens)
                if end - q < r.num_prompt_tokens
            ]
        )
        return cls(list(query_lens), ends, num_logits, num_prompt)


class StepCost(NamedTuple):
    flops: float
    bytes: float


def estimate_step_cost(shape: ModelShape, batch: StepBatch) -> StepCost:
    """FLOPs and bytes of one step (formulas in the module docstring)."""
    tokens, logits = batch.num_tokens, batch.num_logits
    if tokens == 0:
        return StepCost(0.0, 0.0)
    hidden, layers, vocab = shape.hidden_size, shape.num_layers, shape.vocab_size
    q_width = shape.num_heads * shape.head_dim
    kv_width = shape.num_kv_heads * shape.head_dim
    attended = sum([q * c - q * (q - 1) // 2 for q, c in zip(batch.query_lens, batch.context_lens)])
    flops = 2 * tokens * layers * shape.layer_weights
    flops += 4 * layers * q_width * attended + 2 * logits * hidden * vocab
    matmul = layers * shape.layer_weights + (vocab * hidden if logits else 0)
    small = (2 * layers + 1) * hidden + tokens * hidden  # norms, embedding rows
    per_token = 7 * hidden + 4 * q_width + 2 * kv_width + 3 * shape.intermediate_size
    activations = tokens * layers * per_token + logits * (hidden + vocab)
    kv = shape.kv_bytes_per_token * (sum(batch.context_lens) + tokens)
    weight_bytes = matmul * shape.matmul_weight_bytes
    return StepCost(float(flops), weight_bytes + (small + activations) * shape.dtype_bytes + kv)


class RooflineMeter:
    """Cumulative step time and estimated work per phase ("prefill" | "decode").

    Without a model shape (tests of other parts) only steps and time are counted.
    """

    def __init__(self, shape: ModelShape | None) -> None:
        self.shape = shape
        self.phases = {phase: PhaseTotals() for phase in PHASES}

    def record(self, batch: StepBatch, seconds: float) -> StepCost:
        cost = StepCost(0.0, 0.0) if self.shape is None else estimate_step_cost(self.shape, batch)
        totals = self.phases[batch.phase]
        totals.steps += 1
        totals.seconds += seconds
        totals.flops += cost.flops
        totals.bytes += cost.bytes
        return cost

    def reset(self) -> None:
        self.phases = {phase: PhaseTotals() for phase in PHASES}


def roofline_report(
    phases: Mapping[str, PhaseTotals], peak_flops: float, peak_bandwidth: float
) -> dict[str, dict[str, float | None]]:
    """Per phase: achieved FLOP/s and bytes/s, and their % of the peaks (None: unknown)."""
    report: dict[str, dict[str, float | None]] = {}
    for phase, totals in phases.items():
        if totals.steps == 0 or totals.seconds <= 0:
            continue
        flops_per_s = totals.flops / totals.seconds
        bytes_per_s = totals.bytes / totals.seconds
        report[phase] = {
            "steps": totals.steps,
            "seconds": round(totals.seconds, 4),
            "gflop_per_s": _significant(flops_per_s / 1e9),
            "gb_per_s": _significant(bytes_per_s / 1e9),
            "flop_per_byte": _significant(totals.flops / totals.bytes) if totals.bytes else None,
            "pct_compute_roofline": _percent(flops_per_s, peak_flops),
            "pct_bandwidth_roofline": _percent(bytes_per_s, peak_bandwidth),
        }
    return report


def _percent(achieved: float, peak: float) -> float | None:
    return round(100.0 * achieved / peak, 2) if peak > 0 else None


def _significant(value: float, digits: int = 4) -> float:
    return float(f"{value:.{digits}g}")
