"""Ed25519 keys for the run's authority and its members (the `cryptography` library): create, load
and save them (a private key file is written 0600), fingerprints to give on a command line, and
signatures. The run key signs the run config (and, in a private swarm, membership certificates);
nothing trusts a config or a certificate its key did not sign."""

from __future__ import annotations

import base64
import hashlib
import os
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from swarm.core.errors import ConfigError

FINGERPRINT_PREFIX = "sha256:"
FINGERPRINT_HEX = 32  # 128 bits of the key's sha256 on the command line


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def unb64(text: str) -> bytes:
    return base64.b64decode(text.encode(), validate=True)


def public_bytes(key: Ed25519PublicKey) -> bytes:
    return key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def fingerprint(public: bytes) -> str:
    """What a run's members are given to recognize it: `sha256:` and 32 hex digits."""
    return FINGERPRINT_PREFIX + hashlib.sha256(public).hexdigest()[:FINGERPRINT_HEX]


def check_fingerprint(text: str) -> str:
    body = text.removeprefix(FINGERPRINT_PREFIX)
    if len(body) != FINGERPRINT_HEX or any(c not in "0123456789abcdef" for c in body):
        example = FINGERPRINT_PREFIX + "0" * FINGERPRINT_HEX
        raise ConfigError(f"--run-key must look like {example} (the coordinator prints it), got {text!r}")
    return FINGERPRINT_PREFIX + body


class SigningKey:
    """A private key and what it signs."""

    def __init__(self, key: Ed25519PrivateKey) -> None:
        self.key = key
        self.public = public_bytes(key.public_key())

    @classmethod
    def generate(cls) -> SigningKey:
        return cls(Ed25519PrivateKey.generate())

    @classmethod
    def load_or_create(cls, path: str | Path) -> SigningKey:
        """The key in `path` (PEM), or a new one written there (mode 0600) when the file is missing."""
        path = Path(path)
        if path.exists():
            try:
                key = serialization.load_pem_private_key(path.read_bytes(), password=None)
            except (ValueError, TypeError) as e:
                raise ConfigError(f"{path} does not hold a private key: {e}") from None
            if not isinstance(key, Ed25519PrivateKey):
                raise ConfigError(f"{path} holds a {type(key).__name__}, not an Ed25519 key")
            return cls(key)
        key = cls.generate()
        path.parent.mkdir(parents=True, exist_ok=True)
        pem = key.key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(pem)
        return key

    @property
    def fingerprint(self) -> str:
        return fingerprint(self.public)

    def sign(self, data: bytes) -> bytes:
        return self.key.sign(data)


def verify(public: bytes, signature: bytes, data: bytes) -> bool:
    """True if `signature` is `public`'s over `data` (any malformed input is simply False)."""
    try:
        Ed25519PublicKey.from_public_bytes(public).verify(signature, data)
        return True
    except (InvalidSignature, ValueError, TypeError):
        return False
