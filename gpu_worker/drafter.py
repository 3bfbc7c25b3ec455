"""The draft model of speculative decoding (`method: draft_model`): a smaller model with
the target's tokenizer, run in the worker beside it, that proposes k tokens for every
speculating request of a step, batched, before the target verifies them.

The scheduler reserves 1 + k KV slots per speculating request as for any proposer, but
sends placeholders (`WORKER_DRAFT_TOKEN`) as the drafts: their values are only known
here. The draft has its own paged KV cache with as many blocks as the target's, and a
block id means the same block in both, so the target's block tables serve the draft
too and the scheduler's accounting covers both caches.

Per request the draft's KV is valid for its first `computed` positions; it catches up
lazily, only when the request speculates. A step with L known tokens (the last one
sampled, not yet in the target's cache) and k drafts::

    forward 1   positions computed .. L-1 (the prompt at first, later the tokens
                accepted since the previous draft)        -> q_0, d_0 at position L
    forward j   d_{j-2} at position L+j-2, for j = 2..k    -> q_{j-1}, d_{j-1}

k forwards of the whole batch; forwards 2..k are one token per request. The draft KV
written for d_0..d_{k-2} stays valid as far as the target accepts them: after a
verification that accepted a drafts, computed = L + min(a, k - 1). A request that
decodes plainly for a while (the off-switch) or resumes after a preemption (a new
request here: computed = 0) simply has a longer first forward. Blocks shared through
the prefix cache get the same draft K/V from whichever request writes them, as the
tokens and positions are the same.

q_j is the draft's distribution processed exactly as the request's sampling params
process the target's (temperature, top-k/top-p/min-p, penalties over the known tokens,
bias; one-hot for greedy requests), and d_j is drawn from it, so the rejection
sampler's min(1, p/q) test and max(0, p - q) residual keep the target's distribution.
The draws use the drafter's own generator (seeded from the engine's seed), except a
seeded request's, which come from its seed and the draft's position: its own generator
is consumed only by the tokens it emits (the rejection sampler's contract), and its
drafts repeat from run to run.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from kvflow.config import DeviceConfig
from kvflow.errors import ConfigError
from kvflow.gpu_worker.attn_metadata import forward_context
from kvflow.gpu_worker.input_batch import InputBatch
from kvflow.gpu_worker.kv_cache import KVCacheSpec, allocate_kv_cache
from kvflow.gpu_worker.model_files import resolve_model_dir
from kvflow.gpu_worker.model_loader import load_hf_config, load_model
from kvflow.gpu_worker.target_probs import target_probs
from kvflow.gpu_worker.vocab_ops import sample_from_weights
from kvflow.speculative_config import SpeculativeConfig

if TYPE_CHECKING:  # imports Triton: only loaded where graphs are captured
    from kvflow.gpu_worker.cuda_graphs import DecodeGraphs

logger = logging.getLogger(__name__)


@dataclass
class _Pending:
    """One request's drafts of this step, until the target verifies them."""

    num_known: int  # L: tokens known when drafting (drafts start at position L)
    num_drafts: int


class Drafter:
    def __init__(
        self,
        model_dir: Path,
        dtype: torch.dtype,
        device: torch.device,
        attention_backend: str,
        block_size: int,
        kv_dtype: torch.dtype,
        target_vocab_size: int,
        seed: int,
        load_format: str = "auto",
    ) -> None:
        hf_config = load_hf_config(model_dir)
        if int(hf_config.vocab_size) != target_vocab_size:
            raise ConfigError(
                f"the draft model's vocabulary has {hf_config.vocab_size} tokens and the "
                f"target's {target_vocab_size}: a draft model must share the target's tokenizer"
            )
        # The target's load format: with "dummy" a config.json directory drafts too.
        self.model = load_model(
            model_dir, dtype, device, attention_backend, load_format=load_format
        )
        # The target's cache dtype: a quantized format fits any head_dim, and one setting
        # (one --kv-cache-dtype) governs every cache of the engine and its sizing.
        self.kv_spec = KVCacheSpec.from_hf_config(hf_config, block_size, kv_dtype)
        self.device = device
        self.generator = torch.Generator(device=device).manual_seed(seed + 1)
        self.computed: dict[str, int] = {}  # req_id -> draft KV positions valid
        self.pending: dict[str, _Pending] = {}
        # On CUDA (ModelRunner.capture_decode_graphs): forwards 2..k, one token per
        # request, replay a captured graph instead of ~300 kernel launches each.
        self.graphs: DecodeGraphs | None = None

    def initialize_kv_cache(self, num_blocks: int) -> None:
        caches = allocate_kv_cache(self.kv_spec, num_blocks, self.device)
        for layer, cache in zip(self.model.attention_layers(), caches):
            layer.kv_cache = cache

    def forget(self, req_ids: list[str]) -> None:
        """Finished or preempted requests (a resumed one starts again from 0)."""
        for req_id in req_ids:
            self.computed.pop(req_id, None)
            self.pending.pop(req_id, None)

    def clear(self) -> None:
        self.computed.clear()
        self.pending.clear()

    # ---- proposing -------------------------------------------------------------------

    def propose(self, batch: InputBatch, req_ids: list[str]) -> dict[int, torch.Tensor]:
        """Fill in the drafts of `req_ids` (placeholders the plan put in `batch`);
        returns slot -> q [k, V] fp32, the distribution each draft was drawn from."""
        slots = np.array([batch.slot_of[r] for r in req_ids], dtype=np.int64)
        known = batch.num_tokens[slots].copy()  # [R] L
        ks = batch.num_drafts[slots].copy()  # [R] k_r >= 1
        start = np.array([self.computed.get(r, 0) for r in req_ids], dtype=np.int64)
        for req_id, num_known, k in zip(req_ids, known.tolist(), ks.tolist()):
            self.pending[req_id] = _Pending(num_known, k)
        probs: list[list[torch.Tensor]] = [[] for _ in req_ids]
        active = np.arange(len(req_ids))
        num_new = known - start
        for j in range(int(ks.max())):
            active = active[ks[active] > j]
            rows = slots[active]
            logits = self._forward(batch, rows, start[active], num_new[active])
            q = target_probs(logits, batch.sampling.metadata(rows, batch.rows))  # [Ra, V]
            uniforms = self._uniforms(batch, rows, known[active] + j)
            drafts = sample_from_weights(q, uniforms).cpu().numpy()  # [Ra]
            batch.token_ids.numpy()[rows, known[active] + j] = drafts
            for i, r in enumerate(active.tolist()):
                probs[r].append(q[i])
            start[active] = known[active] + j
            num_new[active] = 1
        return {int(s): torch.stack(p) for s, p in zip(slots.tolist(), probs)}

    def _uniforms(
        self, batch: InputBatch, slots: np.ndarray, positions: np.ndarray
    ) -> torch.Tensor:
        """One U[0, 1) per draft. A seeded request's comes from its seed and the
        draft's position alone, so its drafts, hence its tokens, are the same in every
        run, whatever else is in the batch or however often it was preempted."""
        uniforms = torch.rand(len(slots), generator=self.generator, device=self.device)
        for i, (slot, position) in enumerate(zip(slots.tolist(), positions.tolist())):
            params = batch.sampling.params[slot]
            if params is not None and params.seed is not None:
                seed = (params.seed * 1_000_003 + position) % (1 << 63)
                generator = torch.Generator(device=self.device).manual_seed(seed)
                uniforms[i] = torch.rand(1, generator=generator, device=self.device)[0]
        return uniforms

    def _forward(
        self, batch: InputBatch, slots: np.ndarray, start: np.ndarray, num_new: np.ndarray
    ) -> torch.Tensor:
        input_ids, positions, metadata = batch.span_inputs(slots, start, num_new)
        with forward_context(metadata):
            if self.graphs is not None and self.graphs.can_run(metadata):
                hidden = self.graphs.run(input_ids, positions, metadata)
            else:
                hidden = self.model(input_ids, positions)
            logits = self.model.compute_logits(hidden[metadata.logits_indices])
        return logits.float()

    def on_verified(self, req_ids: list[str], num_accepted: list[int]) -> None:
        """The target accepted num_accepted[i] drafts of req_ids[i]: the draft KV of
        those stays (up to k - 1 of them: d_{k-1} was never fed to the draft)."""
        for req_id, accepted in zip(req_ids, num_accepted):
            pending = self.pending.pop(req_id, None)
            if pending is not None:
                extra = min(accepted, pending.num_drafts - 1)
                self.computed[req_id] = pending.num_known + extra


def make_drafter(
    spec: SpeculativeConfig | None,
    device: DeviceConfig,
    block_size: int,
    dtype: torch.dtype,
    kv_dtype: torch.dtype,
    target_vocab_size: int,
    seed: int,
    load_format: str = "auto",
) -> Drafter | None:
    """The draft model of a `draft_model` config (None for other methods): an HF
    directory or a GGUF file (converted once, as the target's)."""
    if spec is None or spec.method != "draft_model":
        return None
    assert spec.model is not None  # the config requires it
    model_dir = resolve_model_dir(spec.model)
    drafter = Drafter(
        model_dir,
        dtype,
        torch.device(device.device),
        device.attention_backend,
        block_size,
        kv_dtype,
        target_vocab_size,
        seed,
        load_format,
    )
    logger.info("draft model %s loaded for %d-token drafts", model_dir, spec.num_speculative_tokens)
    return drafter
