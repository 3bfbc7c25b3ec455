"""The proxy's sans-IO rules: what the prefill instance is asked, and which instances.

A request goes twice: first to a prefill instance, trimmed to compute the prompt only
(one token, no stream, one sample), so that its KV lands where the decode instance
finds it; then, unchanged, to a decode instance, whose answer is the client's. The
client's `n`, stop strings, logprobs and streaming apply to the decode request only:
every sample of a prompt shares that prompt's KV.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from kvflow.cluster_secret import KV_PARAMS_TTL_S, ClusterSecret
from kvflow.routing import Router, RoutingConfig
from kvflow.services.proxy.resume import signed_resume

# Fields that shape the output, not the prompt: the prefill request drops them.
_OUTPUT_FIELDS = (
    "stream",
    "stream_options",
    "n",
    "best_of",
    "use_beam_search",
    "length_penalty",
    "early_stopping",
    "min_tokens",
    "logprobs",
    "top_logprobs",
    "echo",
    "stop",
    "stop_token_ids",
    "response_format",
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "tools",
    "tool_choice",
    "timeout",
    "return_token_ids",
    "kv_resume",
)


def prefill_request(body: dict[str, Any]) -> dict[str, Any]:
    """The prefill instance's request: the same prompt, one greedy token."""
    prefill = {k: v for k, v in body.items() if k not in _OUTPUT_FIELDS}
    prefill["max_tokens"] = 1
    prefill.pop("max_completion_tokens", None)
    prefill["temperature"] = 0.0
    # vLLM's shape: tells a producer this prompt's KV is for a remote decode.
    prefill["kv_transfer_params"] = {"do_remote_decode": True}  # (the client's dropped)
    return prefill


@dataclass
class InstancePools:
    """The prefill and decode instances, each picked round-robin (the data-parallel
    router's policy; the proxy sees no token ids, so no prefix-aware choice)."""

    prefill_urls: list[str]
    decode_urls: list[str]
    # zmq connector: each prefill instance's KV address ("tcp://host:port"), same order;
    # empty with shared storage (the decode instance finds blocks by their keys).
    prefill_kv_addresses: list[str] = field(default_factory=list)
    _prefill: Router = field(init=False)
    _decode: Router = field(init=False)

    def __post_init__(self) -> None:
        if not self.prefill_urls or not self.decode_urls:
            raise ValueError("the proxy needs at least one prefill and one decode instance")
        if self.prefill_kv_addresses and len(self.prefill_kv_addresses) != len(self.prefill_urls):
            raise ValueError("give one --prefill-kv-address per --prefill instance, or none")
        config = RoutingConfig(policy="round-robin")
        self._prefill = Router(config, len(self.prefill_urls))
        self._decode = Router(config, len(self.decode_urls))

    def pick(self, avoid_decode: str | None = None) -> tuple[str, str, str]:
        """(prefill url, its KV address or "", decode url) for the next request; a
        resend passes the decode instance that failed it, taken only if it is the one."""
        prefill = self._prefill.route([]).engine
        decode = self._decode.route([]).engine
        if self.decode_urls[decode] == avoid_decode and len(self.decode_urls) > 1:
            decode = self._decode.route([]).engine
        kv_address = self.prefill_kv_addresses[prefill] if self.prefill_kv_addresses else ""
        return self.prefill_urls[prefill], kv_address, self.decode_urls[decode]


def decode_request(
    body: dict[str, Any],
    kv_address: str,
    secret: ClusterSecret | None,
    now: float,
    resume: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """The decode instance's request: the client's, naming where its prompt KV is, signed
    (a decode instance honours only a remote address the proxy signed). Whatever
    kv_transfer_params or kv_resume the client sent are dropped: they are the proxy's to
    give. `resume`: a broken stream's choices so far (resume.py), signed too."""
    body = {k: v for k, v in body.items() if k not in ("kv_transfer_params", "kv_resume")}
    if resume is not None:
        assert secret is not None, "only a proxy with the cluster secret resumes streams"
        body["kv_resume"] = signed_resume(secret, resume, now)
    if not kv_address:
        return body
    assert secret is not None, "checked at start: a zmq proxy needs the cluster secret"
    request_id = uuid.uuid4().hex
    expires_at = round(now + KV_PARAMS_TTL_S, 3)
    params = {
        "remote_address": kv_address,
        "request_id": request_id,
        "expires_at": expires_at,
        "signature": secret.sign_kv_params(kv_address, request_id, expires_at),
    }
    return {**body, "kv_transfer_params": params}
