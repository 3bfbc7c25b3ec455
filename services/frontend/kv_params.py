"""Only the proxy's `kv_transfer_params` reach the engine.

A decode instance (zmq kv_consumer) pulls a prompt's KV from the producer that
`kv_transfer_params.remote_address` names. Taken from any client, that field would let
anyone point the instance at a fake producer and poison the prefix cache of everyone
who sends the same prompt. So `kvflow proxy` signs it (an HMAC under the cluster secret,
kvflow/cluster_secret.py) over the address, a one-time request id and an expiry:

    proxy: {"remote_address": A, "request_id": R, "expires_at": T, "signature": HMAC(A, R, T)}

and a request whose remote_address is unsigned, signed with another key, expired or
replayed gets a 400 here (counted in kvflow:kv_transfer_params_rejected_total). Without
a cluster secret no remote_address is accepted at all.

`kv_resume` is the proxy's other signed field: a stream whose decode instance died after
the client had some of it goes to another decode instance with what each choice has so
far (a choice that finished is not generated again),

    proxy: {"choices": [{"index": 0, "token_ids": [...], "finished": false}, ...],
            "request_id": R, "expires_at": T, "signature": HMAC(R, T, choices)}

and the frontend sends each unfinished choice's tokens as its output so far
(`AddRequest.output_token_ids`, as after an engine failure inside one server): the engine
recomputes them and samples on, the stream continues where the old one broke. Unsigned,
forged, tampered with, expired or replayed: a 400, counted with the kv_transfer_params
refusals.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import msgspec

from kvflow.cluster_secret import ClusterSecret
from kvflow.errors import InvalidRequestError
from kvflow.proto.sampling import KVTransferParams


class ResumedChoice(msgspec.Struct, forbid_unknown_fields=True):
    """One choice of a broken stream: the output tokens its client has."""

    index: int
    token_ids: list[int]
    finished: bool = False  # its finish_reason went out: it is not generated again


class KVResume(msgspec.Struct, forbid_unknown_fields=True):
    """A request's `kv_resume`: the choices a broken stream had sent, signed."""

    choices: list[ResumedChoice]
    request_id: str | None = None
    expires_at: float | None = None
    signature: str | None = None


class KVParamsGate:
    """Checks kv_transfer_params and kv_resume; remembers the request ids it let through until they
    expire, so a signed set is good for one request only."""

    def __init__(self, secret: ClusterSecret | None, on_refused: Callable[[], None]) -> None:
        self._secret = secret
        self._on_refused = on_refused
        self._used: dict[str, float] = {}  # request id -> expires_at

    def check(self, params: KVTransferParams | None, now: float | None = None) -> None:
        if params is None or not params.remote_address:
            return  # nothing to pull: the instance computes (or loads by key) itself
        now = time.time() if now is None else now
        reason = self._why_refused(params, now)
        if reason is not None:
            self._on_refused()
            raise InvalidRequestError(reason, param="kv_transfer_params")
        assert params.request_id is not None and params.expires_at is not None
        self._forget_expired(now)
        self._used[params.request_id] = params.expires_at

    def check_resume(
        self, resume: KVResume | None, now: float | None = None
    ) -> list[ResumedChoice] | None:
        """The choices a signed resume carries (None without one); 400 otherwise."""
        if resume is None:
            return None
        now = time.time() if now is None else now
        if self._secret is None:
            reason: str | None = (
                "kv_resume needs a cluster secret on this server (--cluster-secret-file): "
                "only the proxy may resume a stream"
            )
        else:
            signed = [(c.index, c.finished, c.token_ids) for c in resume.choices]
            reason = self._secret.check_resume(
                resume.request_id, resume.expires_at, signed, resume.signature, now
            )
        if reason is None and resume.request_id in self._used:
            reason = "kv_resume: this signed request id was already used"
        if reason is not None:
            self._on_refused()
            raise InvalidRequestError(reason, param="kv_resume")
        assert resume.request_id is not None and resume.expires_at is not None
        self._forget_expired(now)
        self._used[resume.request_id] = resume.expires_at
        return resume.choices

    def _why_refused(self, params: KVTransferParams, now: float) -> str | None:
        if self._secret is None:
            return (
                "kv_transfer_params.remote_address needs a cluster secret on this server "
                "(--cluster-secret-file): only the proxy may name a KV producer"
            )
        assert params.remote_address is not None
        reason = self._secret.check_kv_params(
            params.remote_address, params.request_id, params.expires_at, params.signature, now
        )
        if reason is None and params.request_id in self._used:
            return "kv_transfer_params: this signed request id was already used"
        return reason

    def _forget_expired(self, now: float) -> None:
        if len(self._used) < 1024:
            return
        self._used = {rid: exp for rid, exp in self._used.items() if exp >= now}
