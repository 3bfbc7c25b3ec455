"""Only the proxy's kv_transfer_params pass a consumer's frontend: signed under the
cluster secret, unexpired, used once; anything else is a 400 and counted."""

from __future__ import annotations

import msgspec
import pytest

from kvflow.cluster_secret import ClusterSecret
from kvflow.errors import InvalidRequestError
from kvflow.proto.sampling import KVTransferParams
from kvflow.services.frontend.kv_params import KVParamsGate, KVResume
from kvflow.services.proxy.pairing import decode_request

SECRET = ClusterSecret(b"cluster secret of thirty-two bytes")
PRODUCER = "tcp://10.0.0.5:8200"
NOW = 1_000.0


def _signed(secret: ClusterSecret = SECRET, address: str = PRODUCER) -> KVTransferParams:
    body = decode_request({"prompt": "x"}, address, secret, NOW)
    return KVTransferParams(**body["kv_transfer_params"])


class Refusals:
    def __init__(self) -> None:
        self.count = 0

    def __call__(self) -> None:
        self.count += 1


def test_the_proxys_params_pass_once() -> None:
    refused = Refusals()
    gate = KVParamsGate(SECRET, refused)
    params = _signed()
    gate.check(params, now=NOW + 1)
    with pytest.raises(InvalidRequestError, match="already used"):
        gate.check(params, now=NOW + 2)  # a replay
    gate.check(None)
    gate.check(KVTransferParams(do_remote_decode=True))  # no address: nothing to trust
    assert refused.count == 1


@pytest.mark.parametrize(
    "params, match",
    [
        (KVTransferParams(remote_address=PRODUCER), "only as the proxy signed"),
        (_signed(ClusterSecret(b"another secret, thirty-two bytes")), "does not match"),
        (
            msgspec.structs.replace(_signed(), remote_address="tcp://evil:1"),
            "does not match",
        ),
        (msgspec.structs.replace(_signed(), signature="\u00a3\udcd1"), "does not match"),
        (msgspec.structs.replace(_signed(), request_id="a\0b"), "NUL"),
    ],
    ids=["unsigned", "another-key", "address-changed", "non-ascii-signature", "nul-id"],
)
def test_anything_else_is_a_400(params: KVTransferParams, match: str) -> None:
    refused = Refusals()
    with pytest.raises(InvalidRequestError, match=match) as error:
        KVParamsGate(SECRET, refused).check(params, now=NOW + 1)
    assert error.value.status_code == 400 and error.value.param == "kv_transfer_params"
    assert refused.count == 1


def test_expired_and_secretless() -> None:
    with pytest.raises(InvalidRequestError, match="expired"):
        KVParamsGate(SECRET, Refusals()).check(_signed(), now=NOW + 3_600)
    with pytest.raises(InvalidRequestError, match="needs a cluster secret"):
        KVParamsGate(None, Refusals()).check(_signed(), now=NOW + 1)


def _resume(token_ids: list[int], secret: ClusterSecret = SECRET) -> KVResume:
    choices = [
        {"index": 0, "token_ids": token_ids, "finished": False},
        {"index": 1, "token_ids": [3], "finished": True},
    ]
    body = decode_request({"prompt": "x"}, "", secret, NOW, resume=choices)
    return msgspec.convert(body["kv_resume"], KVResume)


def _with(resume: KVResume, token_ids: list[int] | None = None, **fields: object) -> KVResume:
    """`resume` with choice 0's tokens (or its other fields) changed after signing."""
    first = resume.choices[0]
    if token_ids is not None:
        first = msgspec.structs.replace(first, token_ids=token_ids)
    if fields:
        first = msgspec.structs.replace(first, **fields)
    return msgspec.structs.replace(resume, choices=[first, *resume.choices[1:]])


def test_the_proxys_resume_passes_once_with_its_tokens() -> None:
    refused = Refusals()
    gate = KVParamsGate(SECRET, refused)
    resume = _resume([5, 7, 11])
    choices = gate.check_resume(resume, now=NOW + 1)
    assert choices is not None
    assert [(c.index, c.token_ids, c.finished) for c in choices] == [
        (0, [5, 7, 11], False),
        (1, [3], True),
    ]
    with pytest.raises(InvalidRequestError, match="already used"):
        gate.check_resume(resume, now=NOW + 2)
    assert gate.check_resume(None) is None
    assert gate.check_resume(_resume([]), now=NOW + 1) is not None  # a role chunk only
    assert refused.count == 1


@pytest.mark.parametrize(
    "resume, match",
    [
        (msgspec.structs.replace(_resume([5, 7]), signature=None), "only as the proxy signed"),
        (_resume([5, 7], ClusterSecret(b"another secret, thirty-two bytes")), "does not match"),
        (_with(_resume([5, 7]), [5, 8]), "does not match"),
        (_with(_resume([5, 7]), [5, 7, 9]), "does not match"),
        (_with(_resume([5, 7]), finished=True), "does not match"),
        (_with(_resume([5, 7]), index=2), "does not match"),
        (msgspec.structs.replace(_resume([5, 7]), expires_at=NOW + 9_999), "does not match"),
        (msgspec.structs.replace(_resume([5, 7]), signature="%\u00e18"), "does not match"),
        (msgspec.structs.replace(_resume([5, 7]), request_id="a\0b"), "NUL"),
    ],
    ids=[
        "unsigned",
        "another-key",
        "token-changed",
        "token-added",
        "finished-changed",
        "index-changed",
        "expiry-changed",
        "non-ascii-signature",
        "nul-id",
    ],
)
def test_a_forged_or_tampered_resume_is_a_400(resume: KVResume, match: str) -> None:
    refused = Refusals()
    with pytest.raises(InvalidRequestError, match=match) as error:
        KVParamsGate(SECRET, refused).check_resume(resume, now=NOW + 1)
    assert error.value.status_code == 400 and error.value.param == "kv_resume"
    assert refused.count == 1


def test_an_expired_resume_and_one_without_a_secret_are_400s() -> None:
    with pytest.raises(InvalidRequestError, match="expired"):
        KVParamsGate(SECRET, Refusals()).check_resume(_resume([1]), now=NOW + 3_600)
    with pytest.raises(InvalidRequestError, match="needs a cluster secret"):
        KVParamsGate(None, Refusals()).check_resume(_resume([1]), now=NOW + 1)
