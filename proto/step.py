"""Scheduler <-> worker channel: the plan of one engine step and its result.

A request travels in full once (`NewRequestData`, also when it resumes after a
preemption); afterwards only deltas (`CachedRequestData`): new block ids and how far
its KV has been computed. The worker appends the tokens it samples to its own copy of
each request (the persistent batch), so sampled tokens never travel scheduler→worker.
"""

from __future__ import annotations

import msgspec

from kvflow.proto.kv_transfer import KVConnectorMeta, KVTransferStepStats
from kvflow.proto.lora import LoRARequest
from kvflow.proto.multimodal import ImageInput, MRopePositions
from kvflow.proto.sampling import SamplingParams


class NewRequestData(msgspec.Struct, array_like=True, omit_defaults=True):
    req_id: str
    token_ids: list[int]  # prompt + outputs so far (outputs only when resuming)
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: list[int]  # the table of KV cache group 0 (-1: a block left the window)
    num_computed_tokens: int  # KV already in the cache (prefix-cache hit) before this step
    # Images whose placeholder runs this request has still to compute (the worker
    # encodes them, or takes their features from its encoder cache).
    images: list[ImageInput] = []
    # Hybrid KV cache (kvflow/kv_groups.py): the tables of groups 1.. (empty: one group).
    group_block_ids: list[list[int]] = []
    lora_request: LoRARequest | None = None  # the adapter its tokens run through
    mrope: MRopePositions | None = None  # its prompt's M-RoPE positions (Qwen2.5-VL)


class CachedRequestData(msgspec.Struct, array_like=True, omit_defaults=True):
    req_id: str
    new_block_ids: list[int]
    num_computed_tokens: int  # before this step
    # Pipeline parallelism only: the sampled tokens at positions num_computed_tokens..
    # that this step computes from. Only the last stage samples, so the others learn
    # them here (the last stage writes the same values again).
    new_token_ids: list[int] = []
    # Hybrid KV cache: ids appended to the tables of groups 1.. (empty: none, or one group).
    new_group_block_ids: list[list[int]] = []


class GrammarBitmask(msgspec.Struct, array_like=True, gc=False):
    """Guided decoding: which tokens each listed request may sample this step.

    `data` is int32 (little-endian) [len(req_ids), words_per_row], xgrammar's packed
    layout: token 32w + j is bit j of word w, 1 = allowed. Only requests that sample this
    step and whose grammar restricts the next token have a row.
    """

    req_ids: list[str]
    words_per_row: int
    data: bytes


class StepPlan(msgspec.Struct, tag=True, array_like=True, omit_defaults=True, gc=False):
    step_id: int
    new_requests: list[NewRequestData]
    cached_requests: list[CachedRequestData]
    # Tokens to compute per request, in batch order (new and cached interleaved as the
    # scheduler chose them).
    scheduled_req_ids: list[str]
    num_scheduled_tokens: list[int]
    # Requests the worker must forget before this step (finished, aborted, preempted).
    finished_req_ids: list[str] = []
    grammar_bitmask: GrammarBitmask | None = None
    # Speculative decoding: the draft tokens scheduled for a request this step (its
    # num_scheduled_tokens counts them: 1 + k for a decode). The worker verifies them and
    # returns the accepted ones plus one more token in `StepResult.sampled_token_ids`.
    spec_token_ids: dict[str, list[int]] = {}
    # Disaggregated prefill/decode: KV blocks to load before / save after this step.
    kv_connector: KVConnectorMeta | None = None
    # Guided decoding's jump-forward: tokens the scheduler appended to a request without
    # a model step (its grammar allowed nothing else). The worker appends them to the
    # request's known tokens before this step; a later step computes their KV.
    forced_token_ids: dict[str, list[int]] = {}
    # Copy-on-write of KV blocks (beam search): [source, destination] block id pairs the
    # worker copies, in every layer, before this step's forward.
    kv_block_copies: list[list[int]] = []

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens)


class TokenLogprobs(msgspec.Struct, array_like=True, gc=False):
    """Logprobs at one position: index 0 is the chosen token, 1.. the top-N."""

    token_ids: list[int]
    logprobs: list[float]
    rank: int  # 1-based rank of the chosen token in the model's distribution


class StepResult(msgspec.Struct, tag=True, array_like=True, omit_defaults=True, gc=False):
    step_id: int
    req_ids: list[str]  # requests that sampled this step
    sampled_token_ids: list[list[int]]  # aligned with req_ids
    logprobs: list[list[TokenLogprobs]] = []  # aligned with req_ids when any asked
    # Prompt logprobs computed this step, for positions [start, start + len) of the prompt.
    prompt_logprobs: dict[str, list[TokenLogprobs]] = {}
    prompt_logprobs_start: dict[str, int] = {}
    execute_time_s: float = 0.0
    kv_transfer: KVTransferStepStats | None = None  # with a KV connector: what it moved
    # Pipeline parallelism: [stage, start, end] (wall clock, s) of each stage's compute
    # of this step, gathered stage to stage beside the hidden state (step traces).
    stage_spans: list[list[float]] = []
    # The pooling runner: each request's pooled hidden state, aligned with req_ids (its
    # sampled_token_ids entry is empty), float32 little-endian [hidden_size] as raw bytes.
    pooled: list[bytes] = []
    # A model that reads images: the images whose placeholder runs began this step, and
    # those of them whose features came from the encoder cache (not the encoder).
    encoder_cache_queries: int = 0
    encoder_cache_hits: int = 0
    encoder_tokens: int = 0  # image features the vision encoder computed this step


class Shutdown(msgspec.Struct, tag=True, array_like=True):
    """Tells workers to exit cleanly."""


class SchedulerHello(msgspec.Struct, tag=True, array_like=True):
    """A scheduler (re)starting, once it sees every worker subscribed: each rank drops
    the request state it holds from any earlier scheduler, and rank 0 answers with
    WorkerInfo. This is what lets a restarted scheduler pick up running workers."""

    incarnation: str  # random id of this scheduler process
    # Worker processes (their incarnations) to exit: the ranks of a group that lost a
    # rank. A surviving rank learns of a dead peer only at its next collective, so an
    # idle one would keep the old group and the restarted rank would wait at the
    # rendezvous for ever; once they exit, their restart policy forms the group again.
    leave: list[str] = []


WorkerInput = StepPlan | SchedulerHello | Shutdown
