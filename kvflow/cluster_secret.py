"""The cluster secret: one file that every process of a deployment reads, and every key
that guards the links between them, derived from it.

    secret file ── HKDF-SHA256(label) ──┬─ "curve-server"   32 bytes: the CURVE server's secret key
                                        ├─ "curve-client"   32 bytes: the CURVE client's secret key
                                        ├─ "kv-block-keys"  HMAC key: salts the KV transfer keys
                                        ├─ "kv-params"      HMAC key: the proxy's signature
                                        └─ "kv-resume"      HMAC key: the proxy's resumed streams

The derivation is deterministic, so every role derives the same keys from the same file
and no key ever travels: peers need only the file (`--cluster-secret-file PATH` or
`KVFLOW_CLUSTER_SECRET_FILE`). The CURVE public keys come from the secret keys
(kvflow/runtime/cluster_auth.py); the ZAP handler accepts only the cluster's client key.

`--insecure-cluster` (`KVFLOW_INSECURE_CLUSTER=1`) runs tcp:// links without a secret:
they then bind loopback only. Without either, a tcp:// link is refused at start.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kvflow.errors import ConfigError

SECRET_FILE_ENV = "KVFLOW_CLUSTER_SECRET_FILE"
INSECURE_ENV = "KVFLOW_INSECURE_CLUSTER"
MIN_SECRET_BYTES = 16  # `openssl rand -hex 32` gives 64; a short one is a mistake
_HKDF_SALT = b"kvflow-cluster-v1"  # a fixed salt: one secret, one set of keys
KV_PARAMS_TTL_S = 300.0  # a signed kv_transfer_params is good for this long


def hkdf_sha256(secret: bytes, info: bytes, length: int = 32) -> bytes:
    """RFC 5869 HKDF (extract, then expand) with SHA-256."""
    prk = hmac.new(_HKDF_SALT, secret, hashlib.sha256).digest()
    out, block, counter = b"", b"", 1
    while len(out) < length:
        block = hmac.new(prk, block + info + bytes([counter]), hashlib.sha256).digest()
        out += block
        counter += 1
    return out[:length]


@dataclass(frozen=True)
class ClusterSecret:
    """The secret's bytes (never printed) and what derives from them."""

    secret: bytes = field(repr=False)

    def __post_init__(self) -> None:
        if len(self.secret) < MIN_SECRET_BYTES:
            raise ConfigError(
                f"the cluster secret is {len(self.secret)} bytes; it needs at least "
                f"{MIN_SECRET_BYTES} (make one with `openssl rand -hex 32 > FILE`)"
            )

    @classmethod
    def read(cls, path: str | os.PathLike[str]) -> ClusterSecret:
        try:
            data = Path(path).read_bytes().strip()
        except OSError as exc:
            raise ConfigError(f"cannot read the cluster secret file {path}: {exc}") from None
        return cls(data)

    def derive(self, label: str) -> bytes:
        return hkdf_sha256(self.secret, label.encode())

    def salt_block_key(self, key: str) -> str:
        """A KV transfer key under the secret: without it, a prompt guess cannot be
        turned into the key its blocks are stored or served under."""
        return hmac.new(self.derive("kv-block-keys"), key.encode(), hashlib.sha256).hexdigest()

    def sign_kv_params(self, remote_address: str, request_id: str, expires_at: float) -> str:
        return hmac.new(
            self.derive("kv-params"),
            _kv_params_message(remote_address, request_id, expires_at),
            hashlib.sha256,
        ).hexdigest()

    def check_kv_params(
        self,
        remote_address: str,
        request_id: str | None,
        expires_at: float | None,
        signature: str | None,
        now: float | None = None,
    ) -> str | None:
        """Why these kv_transfer_params are not the proxy's, or None if they are."""
        if not signature or request_id is None or expires_at is None:
            return "kv_transfer_params.remote_address is accepted only as the proxy signed it"
        return _verify(
            "kv_transfer_params",
            lambda: self.sign_kv_params(remote_address, request_id, expires_at),
            signature, expires_at, now,
        )  # fmt: skip

    def sign_resume(
        self, request_id: str, expires_at: float, choices: Sequence[ResumedTokens]
    ) -> str:
        """The proxy's signature over a broken stream's choices: each one's index, whether
        it finished, and its output token ids (a resume request)."""
        return hmac.new(
            self.derive("kv-resume"),
            _resume_message(request_id, expires_at, choices),
            hashlib.sha256,
        ).hexdigest()

    def check_resume(
        self,
        request_id: str | None,
        expires_at: float | None,
        choices: Sequence[ResumedTokens],
        signature: str | None,
        now: float | None = None,
    ) -> str | None:
        """Why these resumed choices are not the proxy's, or None if they are."""
        if not signature or not request_id or expires_at is None:
            return "kv_resume is accepted only as the proxy signed it"
        return _verify(
            "kv_resume",
            lambda: self.sign_resume(request_id, expires_at, choices),
            signature, expires_at, now,
        )  # fmt: skip


def _verify(
    field: str, sign: Callable[[], str], signature: str, expires_at: float, now: float | None
) -> str | None:
    """Why a client's copy of a proxy-signed field is not the proxy's, or None. The
    signature is compared in constant time as bytes: a client's may hold any characters,
    and hmac.compare_digest takes only ASCII strings."""
    try:
        expected = sign()
    except ValueError as exc:  # a field no proxy would send (NUL)
        return f"{field}: {exc}"
    given = signature.encode("utf-8", "surrogatepass")
    if not hmac.compare_digest(expected.encode(), given):
        return f"{field}: the signature does not match"
    if (time.time() if now is None else now) > expires_at:
        return f"{field}: the signature has expired"
    return None


# A resumed choice as signed: (choice index, finished, output token ids).
ResumedTokens = tuple[int, bool, Sequence[int]]


def _resume_message(request_id: str, expires_at: float, choices: Sequence[ResumedTokens]) -> bytes:
    if "\0" in request_id:
        raise ValueError("kv_resume's request id may not contain NUL")
    # "index:finished:id,id,...;..." - digits and separators only: unambiguous.
    listed = ";".join(
        f"{int(index)}:{int(finished)}:{','.join(str(int(t)) for t in ids)}"
        for index, finished, ids in choices
    )
    return "\0".join(("kvflow-kv-resume-v1", request_id, f"{expires_at:.3f}", listed)).encode()


def _kv_params_message(remote_address: str, request_id: str, expires_at: float) -> bytes:
    # NUL-separated: no field can run into the next (none may contain NUL, see below).
    fields = ("kvflow-kv-params-v1", remote_address, request_id, f"{expires_at:.3f}")
    if any("\0" in f for f in fields):
        raise ValueError("kv_transfer_params fields may not contain NUL")
    return "\0".join(fields).encode()


@dataclass(frozen=True)
class ClusterSettings:
    """This process's cluster security: the secret, or the explicit insecure opt-out."""

    secret: ClusterSecret | None = None
    insecure: bool = False

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> ClusterSettings:
        env = os.environ if environ is None else environ
        path = env.get(SECRET_FILE_ENV) or None
        insecure = env.get(INSECURE_ENV, "") not in ("", "0", "false")
        return cls(ClusterSecret.read(path) if path else None, insecure)

    def tcp_refusal(self, what: str) -> str | None:
        """Why `what` may not use tcp:// here, or None when it may."""
        if self.secret is not None or self.insecure:
            return None
        return (
            f"{what} uses tcp:// but no cluster secret is set: give --cluster-secret-file PATH "
            f"(or {SECRET_FILE_ENV}) to every process of the cluster, or --insecure-cluster "
            "to run unauthenticated on loopback only"
        )
