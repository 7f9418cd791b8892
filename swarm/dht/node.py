"""The swarm's records on the hivemind DHT: run config, one record per stage (a subkey per peer),
and recent events. Every record is signed (RSASignatureValidator: the subkey is the writer's public
key, so only its owner can overwrite it) and schema-checked (SchemaValidator) on every node.

Values stay small (hundreds of bytes): the DHT carries no tensors.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
from collections import OrderedDict
from collections.abc import Callable

import pydantic.v1 as pydantic
from hivemind.dht import DHT
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.schema import SchemaValidator
from hivemind.utils import get_dht_time
from hivemind.utils.crypto import RSAPrivateKey

from swarm.core.errors import ConfigError
from swarm.core.procs import die_with_parent
from swarm.core.settings import DHT_TIMEOUT_S
from swarm.dht import reachability
from swarm.dht.records import (
    MAX_STAGES,
    AccusationRecord,
    EventRecord,
    PeerEntry,
    PeerRecord,
    SwarmSchema,
    TrainerRecord,
)

logger = logging.getLogger(__name__)

# The registry of runs on a DHT: subkey = the publisher's key, value = a run id. Not of the form
# `{run}_{field}`, so no run's records can collide with it.
RUNS_KEY = "swarm-runs"

# Every record is stored on the REPLICAS nodes nearest to its key (hivemind's num_replicas; the
# polling budget of swarm.policy.polling assumes the same), and every search keeps a beam of that
# many nodes. hivemind's default beam is its bucket size (20): on a DHT of up to 20 nodes, every
# get and every store asked every node, and that traffic cost 1.39-1.42 cores on 15 nodes doing
# what peers do (scripts/bench_dht.py); with this beam, and a view's keys read in one traversal
# (`read_view`), 0.58-0.60.
REPLICAS = 5
SEARCH = {"beam_size": REPLICAS}


async def _get_latest_many(_dht: DHT, node, keys: list[str]) -> dict:
    """In the DHT process: the latest value of each of `keys`, found in one traversal (a node near
    several of the keys answers for all of them in one call)."""
    return await node.get_many(keys, sufficient_expiration_time=float("inf"), **SEARCH)


def load_identity(path: str) -> RSAPrivateKey:
    """The RSA key of a hivemind identity file (created, as hivemind does, if missing): it signs this node's
    records too, so a restarted process with the same file overwrites its own records."""
    from hivemind.p2p import P2P
    from hivemind.proto import crypto_pb2

    if not os.path.isfile(path):
        P2P.generate_identity(path)
    with open(path, "rb") as f:
        proto = crypto_pb2.PrivateKey.FromString(f.read())
    key = RSAPrivateKey.__new__(RSAPrivateKey)
    key.__setstate__({"_private_key": proto.data})
    return key


class _DyingDHT(DHT):
    """hivemind's DHT runs in a forked child that starts a p2pd daemon; neither dies with its owner.

    A SIGKILLed peer must vanish from the swarm, not leave a DHT node and a p2pd serving on its
    behalf, so both get PR_SET_PDEATHSIG: the DHT process dies with the peer, p2pd with the DHT.
    """

    def run(self) -> None:
        die_with_parent()
        original = asyncio.subprocess.create_subprocess_exec

        async def exec_dying_with_parent(*args, **kwargs):
            kwargs.setdefault("preexec_fn", die_with_parent)
            return await original(*args, **kwargs)

        asyncio.subprocess.create_subprocess_exec = exec_dying_with_parent  # only in this child process
        super().run()


VALID_RECORDS_REMEMBERED = 8192  # per validator, in each DHT process


class _ValidRecords:
    """The records a validator found valid lately. Every read of a stage record returns every peer's
    entry, and every node on the way checked each entry's RSA signature and schema again (56% of each
    DHT process's CPU in a 12-peer local swarm); both checks are pure functions of the record, so a
    record seen valid once is valid again. Only valid ones are remembered."""

    def __init__(self) -> None:
        self._seen: OrderedDict[tuple, None] = OrderedDict()

    def check(self, record, validate: Callable[[object], bool]) -> bool:
        key = (record.key, record.subkey, record.value, record.expiration_time)
        if key in self._seen:
            self._seen.move_to_end(key)
            return True
        if not validate(record):
            return False
        self._seen[key] = None
        if len(self._seen) > VALID_RECORDS_REMEMBERED:
            self._seen.popitem(last=False)
        return True


class _SignatureValidator(RSASignatureValidator):
    """hivemind's RSA signature check, remembering the records it found valid (`_ValidRecords`)."""

    def __init__(self, private_key: RSAPrivateKey | None = None) -> None:
        super().__init__(private_key)
        self._valid = _ValidRecords()

    def validate(self, record) -> bool:
        return self._valid.check(record, super().validate)


class _RefusingSchemaValidator(SchemaValidator):
    """hivemind's SchemaValidator raises on some records instead of refusing them (a subkey that is
    msgpack of a list: TypeError "unhashable type"), which fails the store or get that carried the
    record: any error is a refusal here. Records found valid are remembered (`_ValidRecords`)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._valid = _ValidRecords()

    def validate(self, record) -> bool:
        return self._valid.check(record, self._validate)

    def _validate(self, record) -> bool:
        try:
            return super().validate(record)
        except Exception as e:  # noqa: BLE001 - a record the schema cannot even read is refused
            logger.debug("refusing a DHT record the schema validator cannot read: %r", e)
            return False


def schema_validator(run_id: str) -> SchemaValidator:
    """The schema validator every node of the run installs."""
    return _RefusingSchemaValidator(SwarmSchema, allow_extra_keys=True, prefix=run_id)


class SwarmDHT:
    """A hivemind DHT node with the swarm's validators and typed accessors for its records."""

    def __init__(
        self,
        run_id: str,
        initial_peers: list[str] | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        announce_host: str | None = None,
        start_timeout: float = 60.0,
        client_mode: bool = False,
        timeout: float = DHT_TIMEOUT_S,
        identity_path: str | None = None,
    ) -> None:
        """identity_path: a private key file (created if missing) that fixes this node's peer id and the key
        that signs its records, so that a restarted process keeps both."""
        self.run_id = run_id
        self.timeout = timeout
        # a private swarm: this member's certificate goes into every record it writes, and records
        # whose (owner, certificate) the filter refuses are ignored (swarm.cluster.authority)
        self.cert_source: Callable[[], str] | None = None
        self.member_filter: Callable[[bytes, str | None, tuple[str, ...] | None], bool] | None = None
        self.signer = _SignatureValidator(load_identity(identity_path) if identity_path else None)
        self.owner = self.signer.local_public_key
        validators = [schema_validator(run_id), self.signer]
        announce = [f"/ip4/{announce_host}/tcp/{port}"] if announce_host and port else None
        # Create it on the calling thread and keep that thread alive: PR_SET_PDEATHSIG fires when the
        # creating *thread* exits.
        self.dht = _DyingDHT(
            initial_peers=list(initial_peers or []),
            host_maddrs=[f"/ip4/{host}/tcp/{port}"],
            announce_maddrs=announce,
            record_validators=validators,
            client_mode=client_mode,
            num_replicas=REPLICAS,
            start=False,
            **({"identity_path": identity_path} if identity_path else {}),
        )
        try:
            self.dht.run_in_background(await_ready=True, timeout=start_timeout)
        except Exception as e:  # noqa: BLE001 - hivemind raises RuntimeError, P2PDaemonError, TimeoutError...
            self.shutdown()
            first = (initial_peers or ["(none)"])[0]
            why = (str(e).strip().splitlines() or [type(e).__name__])[-1]
            raise ConfigError(
                f"the DHT node did not start or could not join through {first} ({why}): check that --initial-peers "
                "are the multiaddrs the coordinator printed (peer id included) and that it is still running"
                + ("; and that no other process uses this --identity-path" if identity_path else "")
            ) from None
        if not client_mode:
            self.dht.run_coroutine(reachability.register)  # answer other nodes' dial-back requests

    # ---- deadline-bound primitives: every DHT wait ends ----

    def _get(self, key: str):
        return self.dht.get(key, latest=True, return_future=True, **SEARCH).result(timeout=self.timeout)

    def _get_many(self, keys: list[str]) -> dict:
        future = self.dht.run_coroutine(functools.partial(_get_latest_many, keys=keys), return_future=True)
        return future.result(timeout=self.timeout)

    def _store(self, key: str, subkey: bytes, value, expiration_time: float) -> bool:
        future = self.dht.store(
            key, subkey=subkey, value=value, expiration_time=expiration_time, return_future=True, **SEARCH
        )
        return bool(future.result(timeout=self.timeout))

    # ---- keys ----

    def key(self, field: str) -> str:
        return f"{self.run_id}_{field}"

    def stage_key(self, stage: int) -> str:
        if not 0 <= stage < MAX_STAGES:
            raise ValueError(f"stage {stage} outside 0..{MAX_STAGES - 1}")
        return self.key(f"stage_{stage}")

    # ---- addresses ----

    def visible_maddrs(self) -> list[str]:
        return [str(m) for m in self.dht.get_visible_maddrs()]

    def dialback(self, peer_id: str, targets: list[str], timeout_s: float = 10.0) -> dict:
        """Ask DHT node `peer_id` to connect to `targets` ("host:port"); see swarm.dht.reachability."""
        return reachability.ask_dialback(self.dht, peer_id, targets, timeout_s)

    @property
    def peer_id(self) -> str:
        return str(self.dht.peer_id)

    # ---- stage records ----

    def _cert(self) -> str | None:
        return None if self.cert_source is None else self.cert_source()

    def _accepted(self, owner: bytes, cert: str | None, roles: tuple[str, ...] | None = None) -> bool:
        return self.member_filter is None or self.member_filter(owner, cert, roles)

    def announce_peer(self, stage: int, record: PeerRecord, ttl: float) -> bool:
        value = {**record.dict(), "cert": self._cert()}
        return self._store(self.stage_key(stage), self.owner, value, get_dht_time() + ttl)

    def _entries(self, key: str, found) -> list[PeerEntry]:
        entries: list[PeerEntry] = []
        if found is None or not isinstance(found.value, dict):
            return entries
        for owner, item in found.value.items():
            try:
                record = PeerRecord.parse_obj(item.value)
            except pydantic.ValidationError:
                logger.warning("ignoring a malformed record under %s", key)
                continue
            if self._accepted(owner, record.cert):
                entries.append(PeerEntry(owner, record, item.expiration_time))
        return entries

    def get_all_stages(self, num_stages: int) -> dict[int, list[PeerEntry]]:
        """Every stage's peer records (one traversal, within the DHT deadline)."""
        keys = [self.stage_key(k) for k in range(num_stages)]
        found = self._get_many(keys)
        return {k: self._entries(key, found.get(key)) for k, key in enumerate(keys)}

    def read_view(self, num_stages: int) -> tuple[dict[int, list[PeerEntry]], list[AccusationRecord]]:
        """What a view re-reads periodically: every stage's peer records and the accusations, in one
        traversal (within the DHT deadline)."""
        keys = [self.stage_key(k) for k in range(num_stages)]
        found = self._get_many([*keys, self.key("accusations")])
        stages = {k: self._entries(key, found.get(key)) for k, key in enumerate(keys)}
        return stages, self._accusations(found.get(self.key("accusations")))

    # ---- run config ----

    def publish_config(self, signed_config: str, ttl: float) -> bool:
        """The run config (a signed envelope: swarm.cluster.runconfig) under `{run}_config`, and the run's id
        in the registry of runs on this DHT (so that a process given a wrong --run-id learns at once which runs
        there are)."""
        expiration = get_dht_time() + ttl
        self._store(RUNS_KEY, self.owner, self.run_id, expiration)
        return self._store(self.key("config"), self.owner, signed_config, expiration)

    def get_runs(self) -> set[str]:
        """The ids of the runs whose config is published on this DHT (from the registry of runs)."""
        found = self._get(RUNS_KEY)
        if found is None or not isinstance(found.value, dict):
            return set()
        return {item.value for item in found.value.values() if isinstance(item.value, str)}

    def get_config_records(self) -> list[str]:
        """Every run config published for this run, freshest first (anyone can publish one: the
        reader keeps only one signed by the run's key)."""
        found = self._get(self.key("config"))
        if found is None or not isinstance(found.value, dict) or not found.value:
            return []
        items = sorted(found.value.items(), key=lambda kv: -kv[1].expiration_time)
        return [item.value for _, item in items if isinstance(item.value, str)]

    # ---- events ----

    def publish_events(self, events: list[str], ttl: float) -> bool:
        record = EventRecord(events=events[-16:], cert=self._cert())
        return self._store(self.key("events"), self.owner, record.dict(), get_dht_time() + ttl)

    def get_events(self) -> list[str]:
        found = self._get(self.key("events"))
        if found is None or not isinstance(found.value, dict):
            return []
        events: list[str] = []
        for owner, item in found.value.items():
            try:
                record = EventRecord.parse_obj(item.value)
            except pydantic.ValidationError:
                continue
            if self._accepted(owner, record.cert):
                events.extend(record.events)
        return events

    # ---- trainers' metrics ----

    def publish_trainer(self, record: TrainerRecord, ttl: float) -> bool:
        value = {**record.dict(), "cert": self._cert()}
        return self._store(self.key("trainers"), self.owner, value, get_dht_time() + ttl)

    def get_trainers(self) -> list[TrainerRecord]:
        found = self._get(self.key("trainers"))
        if found is None or not isinstance(found.value, dict):
            return []
        out = []
        for owner, item in found.value.items():
            try:
                record = TrainerRecord.parse_obj(item.value)
            except pydantic.ValidationError:
                logger.warning("ignoring a malformed trainer record under %s", self.key("trainers"))
                continue
            if self._accepted(owner, record.cert):
                out.append(record)
        return out

    # ---- accusations of lying peers ----

    def publish_accusations(self, record: AccusationRecord, ttl: float) -> bool:
        value = {**record.dict(), "cert": self._cert()}
        return self._store(self.key("accusations"), self.owner, value, get_dht_time() + ttl)

    def get_accusations(self) -> list[AccusationRecord]:
        """Every trainer's accusations (in a private swarm: only those of admitted trainers)."""
        return self._accusations(self._get(self.key("accusations")))

    def _accusations(self, found) -> list[AccusationRecord]:
        if found is None or not isinstance(found.value, dict):
            return []
        out = []
        for owner, item in found.value.items():
            try:
                record = AccusationRecord.parse_obj(item.value)
            except pydantic.ValidationError:
                logger.warning("ignoring a malformed accusations record under %s", self.key("accusations"))
                continue
            if self._accepted(owner, record.cert, roles=("trainer",)):
                out.append(record)
        return out

    def shutdown(self) -> None:
        try:
            self.dht.shutdown()
        except Exception:  # noqa: BLE001 - shutting down anyway
            logger.debug("DHT shutdown raised", exc_info=True)
