"""Membership of a private swarm: certificates the run's authority (the coordinator, with the run
key) issues to admitted members, and the signature each member puts on every call.

A certificate binds a member's key (Ed25519) and its DHT identity (hivemind's record-owner key) to
the run, a role and an expiry, signed by the run key. A call carries the certificate and the member's
signature over (method, timestamp, nonce): a receiver checks the certificate, the signature, that
the timestamp is within a bounded clock skew and that the nonce was not seen before (a bounded replay
cache). Pure logic and crypto (swarm.core.keys), no I/O: the gRPC interceptors (swarm.wire.auth),
the authority service and the DHT record filter (swarm.cluster.authority) use it."""

from __future__ import annotations

import collections
import hashlib
import hmac
import json
import os
import time
from dataclasses import asdict, dataclass

from swarm.core.keys import SigningKey, b64, unb64, verify

CERT_VERSION = 1
MAX_SKEW_S = 30.0  # a call's timestamp may be this far from the receiver's clock
REPLAY_WINDOW_S = 2 * MAX_SKEW_S
MAX_REMEMBERED_NONCES = 200_000  # the replay cache's bound (about 20 MB)
ROLES = ("peer", "trainer", "observer")


class AuthError(Exception):
    """Why a certificate or a call is not accepted (the server answers UNAUTHENTICATED)."""


@dataclass(frozen=True)
class Certificate:
    run_id: str
    member: bytes  # the member's Ed25519 public key (raw)
    dht_owner: bytes  # its DHT record-owner key (hivemind's RSASignatureValidator.local_public_key)
    role: str
    issued: float
    expires: float
    signature: bytes = b""

    def body(self) -> bytes:
        d = {
            "v": CERT_VERSION,
            "run_id": self.run_id,
            "member": b64(self.member),
            "dht_owner": b64(self.dht_owner),
            "role": self.role,
            "issued": round(self.issued, 3),
            "expires": round(self.expires, 3),
        }
        return json.dumps(d, sort_keys=True, separators=(",", ":")).encode()

    def signed_by(self, key: SigningKey) -> Certificate:
        return Certificate(**{**asdict(self), "signature": key.sign(self.body())})

    def encode(self) -> str:
        return b64(json.dumps({"body": self.body().decode(), "sig": b64(self.signature)}).encode())

    @classmethod
    def decode(cls, text: str) -> Certificate:
        try:
            outer = json.loads(unb64(text))
            d = json.loads(outer["body"])
            if d.get("v") != CERT_VERSION:
                raise ValueError(f"certificate version {d.get('v')!r}")
            return cls(
                str(d["run_id"]), unb64(d["member"]), unb64(d["dht_owner"]), str(d["role"]), float(d["issued"]),
                float(d["expires"]), unb64(outer["sig"]),
            )  # fmt: skip
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise AuthError(f"malformed certificate: {e}") from None

    def check(self, run_key: bytes, run_id: str, now: float | None = None) -> None:
        """Raise AuthError unless the run key signed it, for this run, and it is current."""
        now = time.time() if now is None else now
        if self.run_id != run_id:
            raise AuthError(f"certificate for run {self.run_id!r}, not {run_id!r}")
        if not verify(run_key, self.signature, self.body()):
            raise AuthError("certificate not signed by the run's key")
        if not self.issued - MAX_SKEW_S <= now <= self.expires:
            raise AuthError("certificate expired" if now > self.expires else "certificate not yet valid")


def issue(run_key: SigningKey, run_id: str, member: bytes, dht_owner: bytes, role: str, ttl_s: float) -> Certificate:
    if role not in ROLES:
        raise AuthError(f"unknown role {role!r}")
    now = round(time.time(), 3)  # as encoded: a decoded certificate equals the issued one
    return Certificate(run_id, member, dht_owner, role, now, round(now + ttl_s, 3)).signed_by(run_key)


# ---- admission: proving an invitation ----


def new_token() -> str:
    return b64(os.urandom(24))


def admission_message(
    run_id: str, member: bytes, dht_owner: bytes, role: str, ts: float, tls_key: bytes = b""
) -> bytes:
    """What a member signs (and MACs with the invitation token) to be admitted; a peer's TLS key is
    in it, so nobody on the way can swap in their own key for the run's CA to certify."""
    tls = hashlib.sha256(tls_key).hexdigest() if tls_key else "-"
    return f"admit|{run_id}|{b64(member)}|{b64(dht_owner)}|{role}|{ts:.3f}|{tls}".encode()


def token_mac(token: str, message: bytes) -> bytes:
    return hmac.new(token.encode(), message, "sha256").digest()


# ---- every call ----


def call_message(method: str, ts: float, nonce: bytes) -> bytes:
    return f"call|{method}|{ts:.3f}|{b64(nonce)}".encode()


@dataclass(frozen=True)
class CallProof:
    """What a member attaches to a call (gRPC metadata, swarm.wire.auth)."""

    cert: str
    ts: float
    nonce: bytes
    signature: bytes

    @classmethod
    def make(cls, key: SigningKey, cert: str, method: str) -> CallProof:
        ts, nonce = time.time(), os.urandom(16)
        return cls(cert, ts, nonce, key.sign(call_message(method, ts, nonce)))


class ReplayCache:
    """Nonces seen in the last REPLAY_WINDOW_S, at most MAX_REMEMBERED_NONCES (when full, calls are
    refused until entries age out: bounded memory wins over availability under a flood)."""

    def __init__(self, window_s: float = REPLAY_WINDOW_S, limit: int = MAX_REMEMBERED_NONCES) -> None:
        self.window_s, self.limit = window_s, limit
        self._seen: collections.OrderedDict[bytes, float] = collections.OrderedDict()

    def admit(self, nonce: bytes, now: float) -> None:
        while self._seen and next(iter(self._seen.values())) < now - self.window_s:
            self._seen.popitem(last=False)
        if nonce in self._seen:
            raise AuthError("replayed call (this nonce was seen)")
        if len(self._seen) >= self.limit:
            raise AuthError("too many calls to check; retry later")
        self._seen[nonce] = now


class Verifier:
    """Checks calls against the run's key (certificates cached by their text)."""

    def __init__(self, run_id: str, run_key: bytes) -> None:
        self.run_id, self.run_key = run_id, run_key
        self.replays = ReplayCache()
        self._certs: dict[str, Certificate] = {}

    def certificate(self, text: str, now: float | None = None) -> Certificate:
        cert = self._certs.get(text)
        if cert is None:
            cert = Certificate.decode(text)
            if len(self._certs) > 4096:
                self._certs.clear()
            self._certs[text] = cert
        cert.check(self.run_key, self.run_id, now)
        return cert

    def check_call(self, proof: CallProof, method: str, now: float | None = None) -> Certificate:
        now = time.time() if now is None else now
        cert = self.certificate(proof.cert, now)
        if abs(now - proof.ts) > MAX_SKEW_S:
            raise AuthError(
                f"call timestamp {proof.ts - now:+.0f} s from this peer's clock (allowed +-{MAX_SKEW_S:.0f})"
            )
        if not verify(cert.member, proof.signature, call_message(method, proof.ts, proof.nonce)):
            raise AuthError("call not signed by the certificate's member")
        self.replays.admit(proof.nonce, now)
        return cert
