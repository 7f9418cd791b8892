"""Membership checks of a private swarm (swarm.core.auth): certificates, call proofs, replays."""

import asyncio
import time

import grpc
import pytest

from swarm.cluster.authority import AuthorityService, member_filter
from swarm.core.auth import (
    AuthError,
    CallProof,
    Certificate,
    ReplayCache,
    Verifier,
    admission_message,
    issue,
    token_mac,
)
from swarm.core.keys import SigningKey
from swarm.wire.auth import MemberCredentials, ServerAuth, client_auth, proof_of
from swarm.wire.protocol import pb

RUN = "run-a"


@pytest.fixture
def run_key():
    return SigningKey.generate()


def member_cert(run_key, ttl_s=60.0, run_id=RUN, owner=b"owner", role="peer"):
    member = SigningKey.generate()
    return member, issue(run_key, run_id, member.public, owner, role, ttl_s)


def test_certificate_round_trips_and_checks(run_key):
    _, cert = member_cert(run_key)
    again = Certificate.decode(cert.encode())
    assert again == cert
    again.check(run_key.public, RUN)
    with pytest.raises(AuthError, match="not signed"):
        again.check(SigningKey.generate().public, RUN)
    with pytest.raises(AuthError, match="for run"):
        again.check(run_key.public, "run-b")
    with pytest.raises(AuthError, match="expired"):
        again.check(run_key.public, RUN, now=time.time() + 120)


def test_a_stranger_signed_or_tampered_certificate_is_refused(run_key):
    stranger = SigningKey.generate()
    _, forged = member_cert(stranger)
    with pytest.raises(AuthError, match="not signed"):
        forged.check(run_key.public, RUN)
    _, cert = member_cert(run_key, role="observer")
    promoted = Certificate(cert.run_id, cert.member, cert.dht_owner, "peer", cert.issued, cert.expires, cert.signature)
    with pytest.raises(AuthError, match="not signed"):
        promoted.check(run_key.public, RUN)
    for garbage in ["", "not base64!", "e30=", "x" * 10_000]:
        with pytest.raises(AuthError, match="malformed"):
            Certificate.decode(garbage)


def test_a_call_is_checked_for_signature_skew_and_replay(run_key):
    verifier = Verifier(RUN, run_key.public)
    member, cert = member_cert(run_key)
    proof = CallProof.make(member, cert.encode(), "/swarm.Stage/Info")
    assert verifier.check_call(proof, "/swarm.Stage/Info") == cert
    with pytest.raises(AuthError, match="replayed"):
        verifier.check_call(proof, "/swarm.Stage/Info")
    other = CallProof.make(member, cert.encode(), "/swarm.Stage/Info")
    with pytest.raises(AuthError, match="not signed by the certificate's member"):
        verifier.check_call(other, "/swarm.Stage/Forward")  # signed for another method
    thief = SigningKey.generate()  # holds a copy of the certificate, not the member's key
    with pytest.raises(AuthError, match="not signed by the certificate's member"):
        verifier.check_call(CallProof.make(thief, cert.encode(), "/swarm.Stage/Info"), "/swarm.Stage/Info")
    late = CallProof.make(member, cert.encode(), "/swarm.Stage/Info")
    with pytest.raises(AuthError, match="clock"):
        verifier.check_call(late, "/swarm.Stage/Info", now=time.time() + 45)


def test_the_replay_cache_is_bounded_and_forgets_old_nonces():
    cache = ReplayCache(window_s=10.0, limit=3)
    for i in range(3):
        cache.admit(bytes([i]), now=100.0)
    with pytest.raises(AuthError, match="too many"):
        cache.admit(b"x", now=101.0)
    cache.admit(b"x", now=111.0)  # the first three aged out
    assert len(cache._seen) == 1
    cache.admit(bytes([0]), now=111.0)  # an aged-out nonce is outside the timestamp window anyway


def test_metadata_round_trips_and_missing_metadata_is_refused(run_key):
    member, cert = member_cert(run_key)
    creds = MemberCredentials(member, cert.encode())
    proof = proof_of(creds.metadata("/swarm.Stage/Info"))
    Verifier(RUN, run_key.public).check_call(proof, "/swarm.Stage/Info")
    with pytest.raises(AuthError, match="no membership certificate"):
        proof_of(())
    with pytest.raises(AuthError, match="malformed"):
        proof_of((("swarm-cert", "x"), ("swarm-call", "{not json")))


def test_the_member_filter_wants_a_valid_certificate_naming_the_records_owner(run_key):
    accept = member_filter(RUN, run_key.public)
    _, cert = member_cert(run_key, owner=b"alice")
    assert accept(b"alice", cert.encode())
    assert not accept(b"mallory", cert.encode())  # a copied certificate on someone else's record
    assert not accept(b"alice", None)
    assert not accept(b"alice", "garbage")
    _, forged = member_cert(SigningKey.generate(), owner=b"mallory")
    assert not accept(b"mallory", forged.encode())


def admit_request(member, token, run_id=RUN, role="peer", ts=None):
    ts = time.time() if ts is None else ts
    message = admission_message(run_id, member.public, b"owner", role, ts)
    return pb.AdmitRequest(
        run_id=run_id, member=member.public, dht_owner=b"owner", role=role, timestamp=ts,
        token_mac=token_mac(token, message) if token else b"", signature=member.sign(message),
    )  # fmt: skip


def test_the_authority_admits_invited_or_allowlisted_members_only(run_key):
    listed = SigningKey.generate()
    service = AuthorityService(RUN, run_key, {"secret"}, {listed.public})
    member = SigningKey.generate()
    service._check(admit_request(member, "secret"))
    service._check(admit_request(listed, None))
    with pytest.raises(AuthError, match="not invited"):
        service._check(admit_request(member, "wrong"))
    with pytest.raises(AuthError, match="admits members of run"):
        service._check(admit_request(member, "secret", run_id="run-b"))
    with pytest.raises(AuthError, match="too old"):
        service._check(admit_request(member, "secret", ts=time.time() - 600))
    forged = admit_request(member, "secret")
    forged.member = SigningKey.generate().public  # someone else's key, not signed by it
    with pytest.raises(AuthError, match="not signed"):
        service._check(forged)


def test_a_members_channel_signs_calls_of_every_shape(run_key):
    """Unary and streaming calls alike carry the proof through a real server's check (grpc.aio files
    a client interceptor under one call shape only: a single all-shapes class signed unary calls alone)."""
    member, cert = member_cert(run_key)
    credentials = MemberCredentials(member, cert.encode())

    async def unary(request, context):
        return b"ok"

    async def streaming(request_or_iterator, context):
        yield b"ok"

    handlers = {
        "UU": grpc.unary_unary_rpc_method_handler(unary),
        "US": grpc.unary_stream_rpc_method_handler(streaming),
        "SU": grpc.stream_unary_rpc_method_handler(unary),
        "SS": grpc.stream_stream_rpc_method_handler(streaming),
    }

    async def go():
        server = grpc.aio.server(interceptors=[ServerAuth(Verifier(RUN, run_key.public))])
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("t.S", handlers),))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", interceptors=client_auth(credentials)) as ch:
                return {
                    "UU": await ch.unary_unary("/t.S/UU")(b"x", timeout=10),
                    "US": [r async for r in ch.unary_stream("/t.S/US")(b"x", timeout=10)],
                    "SU": await ch.stream_unary("/t.S/SU")(iter([b"x"]), timeout=10),
                    "SS": [r async for r in ch.stream_stream("/t.S/SS")(iter([b"x"]), timeout=10)],
                }
        finally:
            await server.stop(None)

    assert asyncio.run(go()) == {"UU": b"ok", "US": [b"ok"], "SU": b"ok", "SS": [b"ok"]}
