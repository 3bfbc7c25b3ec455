"""Only the proxy's kv_transfer_params pass a consumer's frontend: signed under the
cluster secret, unexpired, used once; anything else is a 400 and counted."""

from __future__ import annotations

import msgspec
import pytest

from kvflow.cluster_secret import ClusterSecret
from kvflow.errors import InvalidRequestError
from kvflow.proto.sampling import KVTransferParams
from kvflow.services.frontend.kv_params import KVParamsGate
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
    ],
    ids=["unsigned", "another-key", "address-changed"],
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
