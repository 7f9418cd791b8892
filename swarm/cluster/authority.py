"""A private swarm's membership: the authority the coordinator runs (`swarm coordinator --private`)
and what a member does with it.

The coordinator admits a member that proves an invitation (an HMAC with the invitation token from
its --invite-file) or whose key is on its --allowlist, and that holds its key (a signature); it
answers with a short-lived certificate signed by the run key (swarm.core.auth). A member renews its
certificate at half its life. It puts the certificate on every gRPC call (swarm.wire.auth) and in
every DHT record it writes; every member ignores DHT records without a valid one
(`member_filter`).

Unless the coordinator runs with --no-tls, the run's gRPC is over TLS (swarm.core.tls): the
authority holds the run's CA (derived from the run key, pinned by the signed config), serves Admit
over TLS (the invitation carries the CA certificate), and gives each peer a server certificate for
the TLS key it sent, renewed with its membership certificate; every member gets the CA to trust."""

from __future__ import annotations

import hmac
import json
import logging
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import grpc

from swarm.cluster.runconfig import fetch_signed_config
from swarm.core.auth import AuthError, Certificate, admission_message, issue, new_token, token_mac
from swarm.core.errors import ConfigError
from swarm.core.keys import SigningKey, check_fingerprint, unb64, verify
from swarm.core.tls import CA_TTL_S, RunCA, TlsKey, check_ca, check_leaf
from swarm.wire import messages
from swarm.wire.auth import MemberCredentials
from swarm.wire.protocol import pb
from swarm.wire.tls import CHANNEL_OPTIONS, ServerTls, channel_credentials

logger = logging.getLogger(__name__)

CERT_TTL_S = 3600.0
ADMIT_TIMEOUT_S = 15.0
ADMIT_SKEW_S = 60.0
RENEW_RETRY_S = 10.0


@dataclass(frozen=True)
class Invitation:
    """What a member needs to join a private swarm (the coordinator writes it to --invite-file)."""

    run_id: str
    run_key: str  # fingerprint
    authority: str  # host:port of the coordinator's Authority service
    token: str
    tls_ca: str = ""  # the run's TLS CA certificate (PEM): the authority serves over TLS; empty: plaintext

    def write(self, path: str | Path) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(self)))
        tmp.chmod(0o600)
        tmp.replace(path)

    @classmethod
    def read(cls, path: str | Path) -> Invitation:
        try:
            d = json.loads(Path(path).read_text())
            inv = cls(
                str(d["run_id"]), check_fingerprint(str(d["run_key"])), str(d["authority"]), str(d["token"]),
                str(d.get("tls_ca", "")),
            )  # fmt: skip
        except OSError as e:
            raise ConfigError(f"cannot read the invitation {path}: {e.strerror}") from None
        except (ValueError, KeyError, TypeError) as e:
            raise ConfigError(f"{path} is not an invitation of a private swarm: {e}") from None
        return inv


@dataclass(frozen=True)
class Admission:
    """The authority's answer: the membership certificate and, when the run's gRPC is over TLS, the
    run's CA and (for a peer) a server certificate for its TLS key."""

    certificate: str
    expires: float
    tls_ca: bytes = b""
    tls_certificate: bytes = b""


class AuthorityService:
    """The coordinator's side: Admit (`ca`: the run's TLS CA, None when its gRPC is plaintext)."""

    def __init__(
        self,
        run_id: str,
        run_key: SigningKey,
        tokens: set[str],
        allowlist: set[bytes],
        ttl_s: float = CERT_TTL_S,
        ca: RunCA | None = None,
    ) -> None:
        self.run_id, self.run_key, self.tokens, self.allowlist, self.ttl_s = run_id, run_key, tokens, allowlist, ttl_s
        self.ca = ca
        self.admitted = 0

    def _check(self, r: pb.AdmitRequest) -> None:
        if r.run_id != self.run_id:
            raise AuthError(f"this authority admits members of run {self.run_id!r}")
        if abs(time.time() - r.timestamp) > ADMIT_SKEW_S:
            raise AuthError("admission request too old or from a clock far off")
        if r.tls_key and r.role != "peer":
            raise AuthError(f"only peers serve: no TLS server certificate for a {r.role}")
        message = admission_message(r.run_id, r.member, r.dht_owner, r.role, r.timestamp, r.tls_key)
        if not verify(r.member, r.signature, message):
            raise AuthError("the admission request is not signed by the member's key")
        invited = any(hmac.compare_digest(token_mac(t, message), r.token_mac) for t in self.tokens)
        if not invited and r.member not in self.allowlist:
            raise AuthError("not invited: no valid invitation token, and the key is not on the allowlist")

    async def admit(self, raw: bytes, context) -> bytes:
        try:
            request = messages.parse(pb.AdmitRequest, raw)
            self._check(request)
            cert = issue(self.run_key, self.run_id, request.member, request.dht_owner, request.role, self.ttl_s)
            response = pb.AdmitResponse(certificate=cert.encode(), expires=cert.expires)
            if self.ca is not None:
                response.tls_ca = self.ca.pem
                if request.tls_key:
                    response.tls_certificate = self.ca.issue(request.tls_key, request.member)
        except (AuthError, ValueError) as e:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, str(e))
        self.admitted += 1
        return response.SerializeToString()

    def handler(self) -> grpc.GenericRpcHandler:
        return grpc.method_handlers_generic_handler(
            "swarm.Authority", {"Admit": grpc.unary_unary_rpc_method_handler(self.admit)}
        )


def read_allowlist(path: str | None) -> set[bytes]:
    if not path:
        return set()
    try:
        return {unb64(line.strip()) for line in Path(path).read_text().splitlines() if line.strip()}
    except (OSError, ValueError) as e:
        raise ConfigError(f"--allowlist {path}: {e}") from None


def _authority_channel(inv: Invitation) -> grpc.Channel:
    """Over TLS when the invitation carries the run's CA (the authority's certificate must chain to it)."""
    if inv.tls_ca:
        return grpc.secure_channel(inv.authority, channel_credentials(inv.tls_ca.encode()), options=CHANNEL_OPTIONS)
    return grpc.insecure_channel(inv.authority)


def request_certificate(
    inv: Invitation, key: SigningKey, dht_owner: bytes, role: str, tls_key: bytes = b""
) -> Admission:
    """Ask the authority for a certificate (blocking, with a deadline); a peer of a run over TLS sends
    the public half of its TLS key (DER) for a server certificate."""
    ts = time.time()
    message = admission_message(inv.run_id, key.public, dht_owner, role, ts, tls_key)
    request = pb.AdmitRequest(
        run_id=inv.run_id, member=key.public, dht_owner=dht_owner, role=role, timestamp=ts,
        token_mac=token_mac(inv.token, message), signature=key.sign(message), tls_key=tls_key,
    )  # fmt: skip
    with _authority_channel(inv) as channel:
        admit = channel.unary_unary("/swarm.Authority/Admit", response_deserializer=pb.AdmitResponse.FromString)
        try:
            r = admit(request.SerializeToString(), timeout=ADMIT_TIMEOUT_S)
        except grpc.RpcError as e:
            why = "cannot reach" if e.code() == grpc.StatusCode.UNAVAILABLE else "did not admit this process:"
            raise ConfigError(f"the run's authority at {inv.authority} {why} {e.details()}") from None
    return Admission(r.certificate, r.expires, r.tls_ca, r.tls_certificate)


class CertificateKeeper:
    """A member's certificate, renewed in a background thread at half its life. `tls_ca`: the run's
    pinned CA fingerprint when its gRPC is over TLS: the member then trusts that CA, and a peer gets
    (and renews) a server certificate for a TLS key it makes (`server_tls`)."""

    def __init__(
        self, inv: Invitation, dht_owner: bytes, role: str, key: SigningKey | None = None, tls_ca: str = ""
    ) -> None:
        self.inv, self.dht_owner, self.role, self.tls_ca = inv, dht_owner, role, tls_ca
        self.credentials = MemberCredentials(key or SigningKey.generate())
        self.tls_key = TlsKey() if tls_ca and role == "peer" else None
        self.server_tls: ServerTls | None = None
        self.expires = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> CertificateKeeper:
        """Get the first certificate (raising ConfigError when not admitted), then keep it fresh."""
        self._renew()
        self._thread = threading.Thread(target=self._run, name="certificate-keeper", daemon=True)
        self._thread.start()
        return self

    def _renew(self) -> None:
        tls_key = self.tls_key.public_der if self.tls_key is not None else b""
        admission = request_certificate(self.inv, self.credentials.key, self.dht_owner, self.role, tls_key)
        if self.tls_ca:
            self._take_tls(admission)  # checked before anything is replaced
        self.credentials.certificate, self.expires = admission.certificate, admission.expires

    def _take_tls(self, admission: Admission) -> None:
        if not admission.tls_ca:
            raise ConfigError("the run's config says its gRPC is over TLS, but its authority sent no TLS CA")
        ca = check_ca(admission.tls_ca, self.tls_ca)
        if self.tls_key is not None:
            if not admission.tls_certificate:
                raise ConfigError("the run's authority sent no TLS server certificate for this peer")
            leaf = check_leaf(admission.tls_certificate, ca, self.tls_key.public_der)
            if self.server_tls is None:
                self.server_tls = ServerTls(self.tls_key.private_pem, leaf)
            else:
                self.server_tls.update(leaf)
        self.credentials.tls_ca = ca

    def _run(self) -> None:
        while not self._stop.wait(max(RENEW_RETRY_S, (self.expires - time.time()) / 2)):
            try:
                self._renew()
            except ConfigError as e:
                logger.warning("renewing this member's certificate failed (next try in %.0f s): %s", RENEW_RETRY_S, e)
                self._stop.wait(RENEW_RETRY_S)

    def stop(self) -> None:
        self._stop.set()


def member_filter(run_id: str, run_key: bytes):
    """For SwarmDHT.member_filter: a record counts only if its certificate is valid, names the
    record's owner (non-members' records are ignored) and, where `roles` are given, one of them."""
    cache: dict[str, Certificate] = {}

    def accept(owner: bytes, cert_text: str | None, roles: tuple[str, ...] | None = None) -> bool:
        if not cert_text:
            return False
        try:
            cert = cache.get(cert_text) or Certificate.decode(cert_text)
            cert.check(run_key, run_id)
        except AuthError:
            return False
        if len(cache) > 4096:
            cache.clear()
        cache[cert_text] = cert
        return cert.dht_owner == owner and (roles is None or cert.role in roles)

    return accept


def secure(dht, signed, invite: str | None, role: str) -> CertificateKeeper | None:
    """Join a private swarm as a member (nothing to do in an open one): get a certificate, put it on
    this process's DHT records and ignore non-members' records. `signed`: the run's SignedConfig."""
    run = signed.run
    if not run.private:
        return None
    if not invite:
        raise ConfigError(
            f"run {run.run_id!r} is a private swarm: give --invite FILE (the invitation its coordinator wrote "
            "with --invite-file)"
        )
    inv = Invitation.read(invite)
    if inv.run_id != run.run_id or inv.run_key != signed.fingerprint:
        raise ConfigError(f"the invitation {invite} is for run {inv.run_id} ({inv.run_key}), not this one")
    if run.tls_ca and not inv.tls_ca:
        raise ConfigError(f"run {run.run_id!r} is over TLS but the invitation {invite} has no TLS CA: get a fresh one")
    if inv.tls_ca:
        check_ca(inv.tls_ca, run.tls_ca)  # the authority we are about to trust is the run's
    keeper = CertificateKeeper(inv, dht.owner, role, tls_ca=run.tls_ca).start()
    dht.cert_source = lambda: keeper.credentials.certificate
    dht.member_filter = member_filter(run.run_id, signed.key)
    return keeper


async def serve_authority(
    run_id: str,
    key: SigningKey,
    host: str,
    announce_host: str | None,
    port: int,
    invite_file: str,
    allowlist: str | None,
    ttl_s: float = CERT_TTL_S,
    ca: RunCA | None = None,
) -> tuple[grpc.aio.Server, Invitation]:
    """Start the Authority service (over TLS with `ca`, the run's CA) and write the invitation (a
    coordinator restarted with the same invitation file keeps its token: the members' invitations
    stay good)."""
    token = new_token()
    try:
        old = Invitation.read(invite_file)
        if old.run_id == run_id and old.run_key == key.fingerprint:
            token = old.token
    except ConfigError:
        pass
    service = AuthorityService(run_id, key, {token}, read_allowlist(allowlist), ttl_s, ca)
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((service.handler(),))
    if ca is not None:  # its own server certificate, as long-lived as the CA: it lives and dies with it
        own = TlsKey()
        pair = (own.private_pem, ca.issue(own.public_der, key.public, CA_TTL_S))
        bound = server.add_secure_port(f"{host}:{port}", grpc.ssl_server_credentials([pair]))
    else:
        bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise ConfigError(f"cannot listen on {host}:{port} for the authority: is the port in use?")
    await server.start()
    tls_ca = ca.pem.decode() if ca is not None else ""
    invitation = Invitation(run_id, key.fingerprint, f"{announce_host or host}:{bound}", token, tls_ca)
    invitation.write(invite_file)
    return server, invitation


def self_credentials(
    key: SigningKey, run_id: str, dht, role: str = "observer", ttl_s: float = 7 * 86400.0, tls_ca: bytes | None = None
):
    """The authority's own membership (its in-process dashboard calls peers): a certificate it issues
    itself, and the filter on its DHT node (`tls_ca`: the run's CA certificate, over TLS)."""
    member = SigningKey.generate()
    cert = issue(key, run_id, member.public, dht.owner, role, ttl_s)
    dht.cert_source = lambda: cert.encode()
    dht.member_filter = member_filter(run_id, key.public)
    return MemberCredentials(member, cert.encode(), tls_ca)


def join_run(dht, timeout_s: float, run_key: str | None, invite: str | None, role: str, clients=None, allow_model=()):
    """The run's signed config, and membership when the run is private (for tools: status, ledger,
    dashboard). `clients` (a ClientPool) gets the member's credentials. Returns (signed, keeper)."""
    signed = fetch_signed_config(dht, timeout_s, run_key, allow_model)
    keeper = secure(dht, signed, invite, role)
    if keeper is not None and clients is not None:
        clients.credentials = keeper.credentials
    return signed, keeper
