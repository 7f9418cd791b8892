"""TLS for a private swarm's gRPC: the run's certificate authority and its members' server
certificates (X.509 with ECDSA P-256, the `cryptography` library). Pure crypto, no I/O.

The CA's key is derived from the run key (HKDF), so a coordinator restarted with the same run key
has the same CA; the SHA-256 of the CA's public key (`RunConfig.tls_ca`) is in the config the run
key signs, so a member trusts only that CA. A peer makes a TLS key of its own, sends its public half
in the Admit request and gets a server certificate for it signed by the CA. Every member's
certificate carries one fixed name (TLS_NAME): peers are addressed by IP, and clients check that
name with the run's CA as their only root. P-256, not Ed25519: gRPC's BoringSSL refuses Ed25519
certificates (NO_COMMON_SIGNATURE_ALGORITHMS with grpcio 1.85)."""

from __future__ import annotations

import datetime
import hashlib

from cryptography import x509
from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from cryptography.x509.oid import NameOID

from swarm.core.errors import ConfigError
from swarm.core.keys import SigningKey, fingerprint

TLS_NAME = "member.swarm"  # the name in every member's certificate, checked instead of an IP address
CA_TTL_S = 10 * 365 * 86400.0
# Long on purpose: the membership certificate (an hour, checked on every call) is what admits; a
# TLS certificate only says "a server the run's authority certified once". Renewed with the
# membership certificate, so a live peer's never runs out; one no longer admitted loses it in a week.
LEAF_TTL_S = 7 * 86400.0
CLOCK_SLACK_S = 3600.0  # valid from an hour before issue: members' clocks differ
_P256_ORDER = 0xFFFFFFFF00000000FFFFFFFFFFFFFFFFBCE6FAADA7179E84F3B9CAC2FC632551


def key_fingerprint(public: ec.EllipticCurvePublicKey) -> str:
    """`sha256:` and the hex SHA-256 of the key's SubjectPublicKeyInfo: the CA's pin."""
    der = public.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    return "sha256:" + hashlib.sha256(der).hexdigest()


def derive_ca_key(run_key: SigningKey) -> ec.EllipticCurvePrivateKey:
    """The run's CA key, a function of the run key alone (HKDF-SHA256 with its own label)."""
    secret = run_key.key.private_bytes(
        serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption()
    )
    okm = HKDF(hashes.SHA256(), length=48, salt=None, info=b"swarm tls ca v1").derive(secret)
    return ec.derive_private_key(int.from_bytes(okm, "big") % (_P256_ORDER - 1) + 1, ec.SECP256R1())


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _validity(builder: x509.CertificateBuilder, ttl_s: float) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.UTC)
    return builder.not_valid_before(now - datetime.timedelta(seconds=CLOCK_SLACK_S)).not_valid_after(
        now + datetime.timedelta(seconds=ttl_s)
    )


def private_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def cert_pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


class RunCA:
    """The run's certificate authority (held by the coordinator, which holds the run key)."""

    def __init__(self, key: ec.EllipticCurvePrivateKey, run_key_fingerprint: str) -> None:
        self.key = key
        self.fingerprint = key_fingerprint(key.public_key())
        self.name = _name(f"swarm CA {run_key_fingerprint}")
        public = key.public_key()
        builder = x509.CertificateBuilder().subject_name(self.name).issuer_name(self.name).public_key(public)
        builder = _validity(builder.serial_number(x509.random_serial_number()), CA_TTL_S)
        builder = builder.add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        builder = builder.add_extension(
            x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True
        )
        builder = builder.add_extension(x509.SubjectKeyIdentifier.from_public_key(public), critical=False)
        self.cert = builder.sign(key, hashes.SHA256())
        self.pem = cert_pem(self.cert)

    @classmethod
    def derive(cls, run_key: SigningKey) -> RunCA:
        return cls(derive_ca_key(run_key), run_key.fingerprint)

    def issue(self, public_der: bytes, member: bytes, ttl_s: float = LEAF_TTL_S) -> bytes:
        """A server certificate (PEM) for a member's P-256 public key (DER SubjectPublicKeyInfo);
        `member` (its Ed25519 key) names it. ValueError for anything but a P-256 key."""
        try:
            public = serialization.load_der_public_key(public_der)
        except (ValueError, UnsupportedAlgorithm) as e:
            raise ValueError(f"not a public key: {e}") from None
        if not isinstance(public, ec.EllipticCurvePublicKey) or not isinstance(public.curve, ec.SECP256R1):
            raise ValueError("the TLS key must be an ECDSA P-256 key")
        builder = x509.CertificateBuilder().subject_name(_name(fingerprint(member))).issuer_name(self.name)
        builder = _validity(builder.public_key(public).serial_number(x509.random_serial_number()), ttl_s)
        builder = builder.add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        builder = builder.add_extension(x509.SubjectAlternativeName([x509.DNSName(TLS_NAME)]), critical=False)
        builder = builder.add_extension(
            x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False
        )
        builder = builder.add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(self.key.public_key()), critical=False
        )
        return cert_pem(builder.sign(self.key, hashes.SHA256()))


class TlsKey:
    """A member's own TLS key (made in memory at start, never written anywhere)."""

    def __init__(self, key: ec.EllipticCurvePrivateKey | None = None) -> None:
        self.key = key or ec.generate_private_key(ec.SECP256R1())
        self.public_der = self.key.public_key().public_bytes(
            serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
        )
        self.private_pem = private_pem(self.key)


def _load(pem: bytes | str, what: str) -> x509.Certificate:
    try:
        return x509.load_pem_x509_certificate(pem.encode() if isinstance(pem, str) else pem)
    except ValueError as e:
        raise ConfigError(f"TLS: the {what} is not a PEM certificate: {e}") from None


def check_ca(pem: bytes | str, pinned: str) -> bytes:
    """The run's CA certificate (PEM) if its key is the pinned one and it is a valid self-signed CA,
    else ConfigError: a member trusts no other root."""
    ca = _load(pem, "run's CA certificate")
    public = ca.public_key()
    if not isinstance(public, ec.EllipticCurvePublicKey) or key_fingerprint(public) != pinned:
        raise ConfigError(f"TLS: the CA certificate offered is not the run's (its config pins {pinned})")
    try:
        ca.verify_directly_issued_by(ca)
        if not ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca:
            raise ValueError("not a CA")
    except (InvalidSignature, ValueError, TypeError, x509.ExtensionNotFound) as e:
        raise ConfigError(f"TLS: the run's CA certificate is not a valid self-signed CA: {e}") from None
    return cert_pem(ca)


def check_leaf(leaf_pem: bytes, ca_pem: bytes, public_der: bytes) -> bytes:
    """A member's server certificate (PEM) if the run's CA signed it, for this member's key and the
    members' name, and it is current; else ConfigError."""
    leaf, ca = _load(leaf_pem, "server certificate"), _load(ca_pem, "CA certificate")
    try:
        leaf.verify_directly_issued_by(ca)
    except (InvalidSignature, ValueError, TypeError) as e:
        raise ConfigError(f"TLS: the server certificate is not signed by the run's CA: {e}") from None
    own = leaf.public_key().public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    if own != public_der:
        raise ConfigError("TLS: the server certificate is for another key than this member's")
    try:
        names = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        names = x509.SubjectAlternativeName([])
    if TLS_NAME not in names.get_values_for_type(x509.DNSName):
        raise ConfigError(f"TLS: the server certificate does not name {TLS_NAME}")
    now = datetime.datetime.now(datetime.UTC)
    if not leaf.not_valid_before_utc <= now <= leaf.not_valid_after_utc:
        raise ConfigError("TLS: the server certificate is not valid now (is this machine's clock right?)")
    return cert_pem(leaf)
