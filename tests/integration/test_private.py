"""A private swarm against strangers, on real processes: every RPC of a peer refuses a call without a
member's valid proof (none, a stranger-signed certificate, an expired one, a replayed call) with
UNAUTHENTICATED; records written to the DHT by a non-member (or with a member's copied certificate)
are ignored by tools and trainers; a second coordinator publishing its own config for the same run id
is ignored by processes given --run-key; uninvited processes end with one line and exit code 2; and
the members train. Its gRPC is over TLS (the default of a private swarm): a plaintext client and one
trusting another CA fail the handshake, a peer's served certificate chains to the CA the signed config
pins, and a peer given a CA that is not the run's ends with one line and exit code 2."""

import asyncio
import dataclasses
import datetime
import socket
import ssl
import subprocess
import sys

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from swarm.cluster.authority import Invitation, request_certificate
from swarm.core.auth import issue
from swarm.core.keys import SigningKey
from swarm.core.procs import ManagedProcess
from swarm.core.states import PeerState
from swarm.core.tls import TLS_NAME, RunCA, check_ca, check_leaf, derive_ca_key, key_fingerprint
from swarm.dht.node import SwarmDHT
from swarm.dht.records import PeerRecord
from swarm.local import LocalOptions, LocalSwarm
from swarm.status import collect_status
from swarm.wire.auth import MemberCredentials
from swarm.wire.client import StageClient
from swarm.wire.protocol import pb
from swarm.wire.tls import CHANNEL_OPTIONS, channel_credentials
from tests.integration.helpers import assert_all_reaped, run_args

STEPS = 6
BATCH = 16
STAGE_METHODS = [m.name for m in pb.DESCRIPTOR.services_by_name["Stage"].methods]


@pytest.fixture(scope="module")
def swarm(tmp_path_factory):
    opts = LocalOptions(
        stages=2, stage_layout=[1, 1], steps=STEPS, private=True, run_args=run_args(),
        log_dir=str(tmp_path_factory.mktemp("private")),
    )  # fmt: skip
    swarm = LocalSwarm(opts)
    try:
        swarm.start()
        yield swarm
    finally:
        pgids = [p.pgid for p in swarm.all_processes()]
        swarm.stop()
        assert_all_reaped(pgids)


def run_key(swarm) -> SigningKey:
    return SigningKey.load_or_create(swarm.log_dir / "run.key")


def admitted(swarm) -> MemberCredentials:
    """A member admitted the way every process is: proving the invitation to the coordinator (over
    TLS: the invitation carries the run's CA, which the answer repeats for the member to trust)."""
    key = SigningKey.generate()
    admission = request_certificate(Invitation.read(swarm.invite), key, b"test-observer", "observer")
    assert admission.tls_ca, "a private swarm's gRPC is over TLS by default"
    return MemberCredentials(key, admission.certificate, admission.tls_ca)


def open_channel(address: str, tls_ca: bytes | None) -> grpc.aio.Channel:
    """A channel as members open them (TLS trusting `tls_ca`), or a plaintext one."""
    if tls_ca is None:
        return grpc.aio.insecure_channel(address)
    return grpc.aio.secure_channel(address, channel_credentials(tls_ca), options=CHANNEL_OPTIONS)


def empty_request(method: str) -> bytes:
    """Some well-formed bytes for the method (the calls must be refused before they are read)."""
    if method.endswith("Stream"):
        return pb.Chunk(header=b"", parts=[0]).SerializeToString()
    return b""


async def call(address: str, method: str, metadata, tls_ca: bytes | None) -> grpc.StatusCode:
    path = f"/swarm.Stage/{method}"
    descriptor = pb.DESCRIPTOR.services_by_name["Stage"].methods_by_name[method]
    async with open_channel(address, tls_ca) as channel:
        try:
            if descriptor.client_streaming:
                stub = channel.stream_stream(path)
                async for _ in stub(iter([empty_request(method)]), metadata=metadata, timeout=10):
                    pass
            elif descriptor.server_streaming:
                async for _ in channel.unary_stream(path)(empty_request(method), metadata=metadata, timeout=10):
                    pass
            else:
                await channel.unary_unary(path)(empty_request(method), metadata=metadata, timeout=10)
        except grpc.aio.AioRpcError as e:
            return e.code()
    return grpc.StatusCode.OK


def test_every_rpc_refuses_non_members(swarm):
    address = swarm.peers[0].ready["address"]
    stranger_key = SigningKey.generate()
    stranger_cert = issue(stranger_key, swarm.run_id, stranger_key.public, b"x", "peer", 600.0)
    stranger = MemberCredentials(stranger_key, stranger_cert.encode())
    member_key = SigningKey.generate()
    expired = MemberCredentials(
        member_key, issue(run_key(swarm), swarm.run_id, member_key.public, b"x", "peer", -60.0).encode()
    )
    other_run = MemberCredentials(
        member_key, issue(run_key(swarm), "another-run", member_key.public, b"x", "peer", 600.0).encode()
    )
    member = admitted(swarm)
    ca = member.tls_ca  # the transport is fine: the membership proof is what is refused

    async def go():
        codes = {}
        for method in STAGE_METHODS:
            path = f"/swarm.Stage/{method}"
            replayed = member.metadata(path)
            await call(address, method, replayed, ca)  # the first use of this proof is allowed
            codes[method] = {
                "none": await call(address, method, None, ca),
                "stranger": await call(address, method, stranger.metadata(path), ca),
                "expired": await call(address, method, expired.metadata(path), ca),
                "other run": await call(address, method, other_run.metadata(path), ca),
                "replayed": await call(address, method, replayed, ca),
                "signed for another method": await call(address, method, member.metadata("/swarm.Stage/Info"), ca),
            }
        codes["member Info"] = await call(address, "Info", member.metadata("/swarm.Stage/Info"), ca)
        return codes

    codes = asyncio.run(go())
    assert codes.pop("member Info") == grpc.StatusCode.OK  # the control: a member is served
    assert set(codes) == set(STAGE_METHODS) and len(STAGE_METHODS) == 9
    wrong = {
        (method, why): code
        for method, by_kind in codes.items()
        for why, code in by_kind.items()
        if code != grpc.StatusCode.UNAUTHENTICATED and not (method == "Info" and why == "signed for another method")
    }
    assert not wrong, f"calls not refused with UNAUTHENTICATED: {wrong}"


def test_non_members_records_are_ignored_and_members_train(swarm):
    outsider = SwarmDHT(swarm.run_id, swarm.initial_peers, client_mode=True)
    try:
        real = outsider._get(outsider.stage_key(0)).value
        stolen_cert = next(iter(real.values())).value["cert"]
        assert stolen_cert, "the member's record carries its certificate"
        fake = PeerRecord(
            peer_id="12D3KooWFakeFakeFakeFakeFakeFakeFakeFakeFakeFake", state=PeerState.ONLINE.value,
            address="127.0.0.1:9", throughput=1e6, queue=0, step=0, version="0",
        )  # fmt: skip
        assert outsider.announce_peer(0, fake, ttl=300)  # no certificate
        assert outsider.publish_events(['{"event": "join", "peer": "forged"}'], ttl=300)
        outsider.cert_source = lambda: stolen_cert  # a member's certificate on a stranger's records
        assert outsider.announce_peer(1, fake, ttl=300)
        raw = {k: len(outsider._get(outsider.stage_key(k)).value) for k in (0, 1)}
        assert raw == {0: 2, 1: 2}, "the forged records are in the DHT"

        status = asyncio.run(
            collect_status(swarm.run_id, swarm.initial_peers, run_key=swarm.run_key, invite=swarm.invite)
        )
        assert status["security"] == "private"
        for stage in status["stages"]:
            assert [p["id"] for p in stage["peers"]] != [] and fake.peer_id not in [p["id"] for p in stage["peers"]]
        assert all(e.get("peer") != "forged" for e in status["events"])

        swarm.start_trainers()
        (summary,) = swarm.wait_trainers(timeout=600)
    finally:
        outsider.shutdown()
    assert summary["steps"] == STEPS and summary["samples"] == STEPS * BATCH
    assert summary["loss_last"] < summary["loss_first"]
    assert summary["failed_calls_by_code"] == {} and summary["peer_failures"] == 0  # never routed to the fake


def test_a_second_coordinator_of_the_same_run_id_is_ignored(swarm):
    rogue = ManagedProcess(
        "rogue-coordinator",
        [
            sys.executable, "-m", "swarm.cli", "coordinator", "--run-id", swarm.run_id,
            "--initial-peers", *swarm.initial_peers, "--host", "127.0.0.1", *run_args(global_batch=64),
        ],
        swarm.log_dir / "rogue.log",
    )  # fmt: skip
    try:
        rogue.wait_ready(120)
        status = asyncio.run(
            collect_status(swarm.run_id, swarm.initial_peers, run_key=swarm.run_key, invite=swarm.invite)
        )
        assert status["security"] == "private"  # the real config: the rogue's is open
        refused = join_as_peer(swarm, with_run_key=False)
        assert refused.returncode == 2, refused.stderr
        assert "--run-key" in refused.stderr.strip().splitlines()[-1]  # two signers: refuses to guess
    finally:
        rogue.stop(timeout=15)
        assert_all_reaped([rogue.pgid])


def join_as_peer(swarm, with_run_key=True, invite=None) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "swarm.cli", "peer", "--run-id", swarm.run_id, "--initial-peers",
            *swarm.initial_peers, "--stage", "0", "--host", "127.0.0.1", "--join-timeout", "20"]  # fmt: skip
    if with_run_key:
        argv += ["--run-key", swarm.run_key]
    if invite:
        argv += ["--invite", str(invite)]
    return subprocess.run(argv, capture_output=True, text=True, timeout=120)


def test_uninvited_processes_end_with_one_clear_line(swarm, tmp_path):
    uninvited = join_as_peer(swarm)
    assert uninvited.returncode == 2
    assert "private swarm" in uninvited.stderr.strip().splitlines()[-1]
    assert "--invite" in uninvited.stderr.strip().splitlines()[-1]

    real = Invitation.read(swarm.invite)
    forged = dataclasses.replace(real, token="a guessed token")
    forged.write(tmp_path / "forged.json")
    refused = join_as_peer(swarm, invite=tmp_path / "forged.json")
    assert refused.returncode == 2
    assert "did not admit" in refused.stderr.strip().splitlines()[-1]
    assert "not invited" in refused.stderr.strip().splitlines()[-1]


# ---- the transport: TLS under the run's CA ----


def test_a_plaintext_client_or_one_trusting_another_ca_is_not_served(swarm):
    address = swarm.peers[0].ready["address"]
    member = admitted(swarm)
    strangers_ca = RunCA.derive(SigningKey.generate()).pem

    async def info(credentials: MemberCredentials) -> str:
        client = StageClient(address, credentials=credentials)
        try:
            await client.info(timeout=10)
            return "OK"
        except grpc.aio.AioRpcError as e:
            return f"{e.code().name}: {e.details()}"
        finally:
            await client.close()

    async def go():
        return {
            "member": await info(member),
            "plaintext": await call(address, "Info", member.metadata("/swarm.Stage/Info"), None),
            "another CA": await info(MemberCredentials(member.key, member.certificate, strangers_ca)),
        }

    codes = asyncio.run(go())
    assert codes["member"] == "OK"
    assert codes["plaintext"] == grpc.StatusCode.UNAVAILABLE  # the server speaks only TLS
    assert codes["another CA"].startswith("UNAVAILABLE") and "handshake" in codes["another CA"].lower()


def served_certificate(address: str, ca_pem: bytes) -> bytes:
    """The certificate a peer serves, read with Python's own TLS stack (OpenSSL, not gRPC's
    BoringSSL), which checks the chain to `ca_pem` and the members' name."""
    host, port = address.rsplit(":", 1)
    context = ssl.create_default_context(cadata=ca_pem.decode())
    context.set_alpn_protocols(["h2"])
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        with context.wrap_socket(sock, server_hostname=TLS_NAME) as tls:
            return ssl.DER_cert_to_PEM_cert(tls.getpeercert(binary_form=True)).encode()


def test_a_peers_certificate_chains_to_the_ca_the_run_key_pins(swarm):
    pinned = swarm.coordinator.ready["tls_ca"]
    assert pinned == key_fingerprint(derive_ca_key(run_key(swarm)).public_key())  # derived from the run key
    ca = check_ca(Invitation.read(swarm.invite).tls_ca, pinned)
    for peer in swarm.peers:
        pem = served_certificate(peer.ready["address"], ca)
        leaf = x509.load_pem_x509_certificate(pem)
        own = leaf.public_key().public_bytes(
            serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
        )
        check_leaf(pem, ca, own)  # signed by the run's CA, names the members, current
        assert leaf.subject.rfc4514_string().startswith("CN=sha256:")  # the member's key fingerprint
        assert leaf.not_valid_after_utc - leaf.not_valid_before_utc <= datetime.timedelta(days=8)


def test_a_peer_whose_tls_setup_fails_ends_with_one_clear_line(swarm, tmp_path):
    real = Invitation.read(swarm.invite)
    another_ca = dataclasses.replace(real, tls_ca=RunCA.derive(SigningKey.generate()).pem.decode())
    another_ca.write(tmp_path / "another-ca.json")
    refused = join_as_peer(swarm, invite=tmp_path / "another-ca.json")
    assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr[-2000:]
    assert "TLS" in refused.stderr.strip().splitlines()[-1] and "not the run's" in refused.stderr

    dataclasses.replace(real, tls_ca="").write(tmp_path / "no-ca.json")
    refused = join_as_peer(swarm, invite=tmp_path / "no-ca.json")
    assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr[-2000:]
    assert "has no TLS CA" in refused.stderr.strip().splitlines()[-1]
