"""TLS of a private swarm (swarm.core.tls, swarm.wire.tls): the run's CA derived from the run key, the
chain a member checks, the admission that hands out server certificates, and real handshakes on
loopback (a member's client is served; a plaintext client and one trusting another CA are not)."""

import asyncio
import time

import grpc
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from swarm.cluster.authority import AuthorityService, CertificateKeeper, Invitation
from swarm.core.auth import AuthError, admission_message, token_mac
from swarm.core.errors import ConfigError
from swarm.core.keys import SigningKey
from swarm.core.tls import RunCA, TlsKey, check_ca, check_leaf, derive_ca_key, key_fingerprint
from swarm.wire.protocol import pb
from swarm.wire.tls import CHANNEL_OPTIONS, ServerTls, channel_credentials

RUN = "run-a"


@pytest.fixture(scope="module")
def run_key():
    return SigningKey.generate()


@pytest.fixture(scope="module")
def ca(run_key):
    return RunCA.derive(run_key)


def test_the_ca_key_is_a_function_of_the_run_key(run_key, ca):
    again = RunCA.derive(run_key)
    assert again.fingerprint == ca.fingerprint and again.pem != ca.pem  # a new certificate, the same key
    assert key_fingerprint(derive_ca_key(SigningKey.generate()).public_key()) != ca.fingerprint
    assert check_ca(again.pem, ca.fingerprint) == again.pem  # a restarted coordinator's CA still matches the pin


def test_a_member_checks_its_chain(ca):
    member, tls = SigningKey.generate(), TlsKey()
    leaf = ca.issue(tls.public_der, member.public)
    assert check_leaf(leaf, check_ca(ca.pem, ca.fingerprint), tls.public_der) == leaf
    other = RunCA.derive(SigningKey.generate())
    with pytest.raises(ConfigError, match="not the run's"):
        check_ca(other.pem, ca.fingerprint)
    with pytest.raises(ConfigError, match="not signed by the run's CA"):
        check_leaf(other.issue(tls.public_der, member.public), ca.pem, tls.public_der)
    with pytest.raises(ConfigError, match="another key"):
        check_leaf(leaf, ca.pem, TlsKey().public_der)
    with pytest.raises(ConfigError, match="not valid now"):
        check_leaf(ca.issue(tls.public_der, member.public, ttl_s=-1800.0), ca.pem, tls.public_der)
    with pytest.raises(ConfigError, match="not a PEM"):
        check_leaf(b"garbage", ca.pem, tls.public_der)


def test_only_p256_keys_are_certified(ca):
    with pytest.raises(ValueError, match="P-256"):
        ca.issue(SigningKey.generate().key.public_key().public_bytes(
            serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
        ), b"m")  # fmt: skip
    p384 = ec.generate_private_key(ec.SECP384R1()).public_key()
    der = p384.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    with pytest.raises(ValueError, match="P-256"):
        ca.issue(der, b"m")
    with pytest.raises(ValueError, match="not a public key"):
        ca.issue(b"junk", b"m")


def admit_request(member, role="peer", tls_key=b"", signed_tls_key=None):
    ts = time.time()
    message = admission_message(
        RUN, member.public, b"owner", role, ts, tls_key if signed_tls_key is None else signed_tls_key
    )
    return pb.AdmitRequest(
        run_id=RUN, member=member.public, dht_owner=b"owner", role=role, timestamp=ts,
        token_mac=token_mac("secret", message), signature=member.sign(message), tls_key=tls_key,
    )  # fmt: skip


class Aborted(Exception):
    pass


class Context:
    async def abort(self, code, details):
        raise Aborted(code, details)


def admit(service, request) -> pb.AdmitResponse:
    raw = asyncio.run(service.admit(request.SerializeToString(), Context()))
    return pb.AdmitResponse.FromString(raw)


def test_the_authority_certifies_a_peers_signed_tls_key(run_key, ca):
    service = AuthorityService(RUN, run_key, {"secret"}, set(), ca=ca)
    member, tls = SigningKey.generate(), TlsKey()
    response = admit(service, admit_request(member, tls_key=tls.public_der))
    check_leaf(response.tls_certificate, check_ca(response.tls_ca, ca.fingerprint), tls.public_der)
    trainer = admit(service, admit_request(SigningKey.generate(), role="trainer"))
    assert trainer.tls_ca == ca.pem and not trainer.tls_certificate  # trusts the CA, serves nothing
    with pytest.raises(AuthError, match="only peers"):
        service._check(admit_request(member, role="trainer", tls_key=tls.public_der))
    # a key swapped in on the way is not the one the member signed (and MACed with the token)
    with pytest.raises(AuthError, match="not signed"):
        service._check(admit_request(member, tls_key=TlsKey().public_der, signed_tls_key=tls.public_der))
    plain = AuthorityService(RUN, run_key, {"secret"}, set())
    assert not admit(plain, admit_request(member, tls_key=tls.public_der)).tls_ca


def test_the_keeper_refuses_a_ca_that_is_not_the_runs(run_key, ca, monkeypatch):
    other = RunCA.derive(SigningKey.generate())
    tls = TlsKey()

    def fake_admission(*args, **kwargs):
        from swarm.cluster.authority import Admission

        return Admission("cert", time.time() + 60, other.pem, other.issue(tls.public_der, b"m"))

    monkeypatch.setattr("swarm.cluster.authority.request_certificate", fake_admission)
    keeper = CertificateKeeper(
        Invitation(RUN, run_key.fingerprint, "x:1", "t"), b"owner", "peer", tls_ca=ca.fingerprint
    )
    with pytest.raises(ConfigError, match="not the run's"):
        keeper._renew()
    assert keeper.server_tls is None and keeper.credentials.tls_ca is None and not keeper.credentials.certificate


async def _echo_server(server_tls: ServerTls) -> tuple[grpc.aio.Server, int]:
    server = grpc.aio.server()
    echo = grpc.unary_unary_rpc_method_handler(lambda request, context: request)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("t.Echo", {"E": echo}),))
    port = server.add_secure_port("127.0.0.1:0", server_tls.credentials())
    await server.start()
    return server, port


async def _call(channel: grpc.aio.Channel) -> grpc.StatusCode | bytes:
    async with channel:
        try:
            return await channel.unary_unary("/t.Echo/E")(b"hello", timeout=10)
        except grpc.aio.AioRpcError as e:
            return e.code()


def test_handshakes_trust_only_the_runs_ca(ca):
    tls = TlsKey()
    server_tls = ServerTls(tls.private_pem, ca.issue(tls.public_der, b"m"))
    other = RunCA.derive(SigningKey.generate())

    async def go():
        server, port = await _echo_server(server_tls)
        address = f"127.0.0.1:{port}"
        try:
            member = await _call(grpc.aio.secure_channel(address, channel_credentials(ca.pem), CHANNEL_OPTIONS))
            plaintext = await _call(grpc.aio.insecure_channel(address))
            stranger = await _call(grpc.aio.secure_channel(address, channel_credentials(other.pem), CHANNEL_OPTIONS))
            server_tls.update(ca.issue(tls.public_der, b"m"))  # renewed: the next handshake gets it
            renewed = await _call(grpc.aio.secure_channel(address, channel_credentials(ca.pem), CHANNEL_OPTIONS))
            return member, plaintext, stranger, renewed
        finally:
            await server.stop(None)

    member, plaintext, stranger, renewed = asyncio.run(go())
    assert member == b"hello" and renewed == b"hello"
    assert plaintext == grpc.StatusCode.UNAVAILABLE and stranger == grpc.StatusCode.UNAVAILABLE
