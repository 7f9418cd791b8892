"""The swarm's records on the hivemind DHT: run config, one record per stage (a subkey per peer),
and recent events. Every record is signed (RSASignatureValidator: the subkey is the writer's public
key, so only its owner can overwrite it) and schema-checked (SchemaValidator) on every node.

Values stay small (hundreds of bytes): the DHT carries no tensors.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import pydantic.v1 as pydantic
from hivemind.dht import DHT
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.schema import SchemaValidator
from hivemind.utils import get_dht_time

logger = logging.getLogger(__name__)

MAX_STAGES = 64
PEER_STATES = ("joining", "online", "draining", "offline")


class PeerRecord(pydantic.BaseModel):
    """What a peer announces about itself under its stage's key (strict types: no conversions)."""

    peer_id: pydantic.constr(strict=True, max_length=80)
    state: Literal["joining", "online", "draining", "offline"]
    address: pydantic.constr(strict=True, max_length=200)
    throughput: pydantic.confloat(strict=True, ge=0.0)
    queue: pydantic.conint(strict=True, ge=0)
    step: pydantic.conint(strict=True, ge=0)
    version: pydantic.constr(strict=True, max_length=40)
    device: pydantic.constr(strict=True, max_length=40) = "cpu"

    class Config:
        extra = pydantic.Extra.forbid


class EventRecord(pydantic.BaseModel):
    events: pydantic.conlist(pydantic.constr(strict=True, max_length=400), max_items=16)

    class Config:
        extra = pydantic.Extra.forbid


_OwnerKey = pydantic.conbytes(strict=True, max_length=1024)
_schema_fields: dict = {f"stage_{k}": (dict[_OwnerKey, PeerRecord] | None, None) for k in range(MAX_STAGES)}
_schema_fields["config"] = (dict[_OwnerKey, pydantic.constr(strict=True, max_length=4000)] | None, None)
_schema_fields["events"] = (dict[_OwnerKey, EventRecord] | None, None)
# hivemind's SchemaValidator is written against pydantic's v1 API (pydantic.v1 under pydantic 2).
SwarmSchema = pydantic.create_model("SwarmSchema", __module__=__name__, **_schema_fields)


_PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """Ask Linux to kill this process when the thread that created it exits (no-op elsewhere)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, sig)
    except OSError:
        pass


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


@dataclass(frozen=True)
class PeerEntry:
    owner: bytes
    record: PeerRecord
    expiration: float


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
        timeout: float = 15.0,
    ) -> None:
        self.run_id = run_id
        self.timeout = timeout
        self.signer = RSASignatureValidator()
        self.owner = self.signer.local_public_key
        validators = [SchemaValidator(SwarmSchema, allow_extra_keys=True, prefix=run_id), self.signer]
        announce = [f"/ip4/{announce_host}/tcp/{port}"] if announce_host and port else None
        # Create it on the calling thread and keep that thread alive: PR_SET_PDEATHSIG fires when the
        # creating *thread* exits.
        self.dht = _DyingDHT(
            initial_peers=list(initial_peers or []),
            host_maddrs=[f"/ip4/{host}/tcp/{port}"],
            announce_maddrs=announce,
            record_validators=validators,
            client_mode=client_mode,
            start=False,
        )
        self.dht.run_in_background(await_ready=True, timeout=start_timeout)

    # ---- deadline-bound primitives: every DHT wait ends ----

    def _get(self, key: str):
        return self.dht.get(key, latest=True, return_future=True).result(timeout=self.timeout)

    def _store(self, key: str, subkey: bytes, value, expiration_time: float) -> bool:
        future = self.dht.store(key, subkey=subkey, value=value, expiration_time=expiration_time, return_future=True)
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

    @property
    def peer_id(self) -> str:
        return str(self.dht.peer_id)

    # ---- stage records ----

    def announce_peer(self, stage: int, record: PeerRecord, ttl: float) -> bool:
        return self._store(self.stage_key(stage), self.owner, record.dict(), get_dht_time() + ttl)

    def get_stage(self, stage: int, latest: bool = True) -> list[PeerEntry]:
        found = self._get(self.stage_key(stage))
        entries: list[PeerEntry] = []
        if found is None or not isinstance(found.value, dict):
            return entries
        for owner, item in found.value.items():
            try:
                entries.append(PeerEntry(owner, PeerRecord.parse_obj(item.value), item.expiration_time))
            except pydantic.ValidationError:
                logger.warning("ignoring a malformed record under %s", self.stage_key(stage))
        return entries

    def get_all_stages(self, num_stages: int) -> dict[int, list[PeerEntry]]:
        futures = {k: self.dht.get(self.stage_key(k), latest=True, return_future=True) for k in range(num_stages)}
        out: dict[int, list[PeerEntry]] = {}
        for k, fut in futures.items():
            found = fut.result(timeout=self.timeout)
            out[k] = []
            if found is None or not isinstance(found.value, dict):
                continue
            for owner, item in found.value.items():
                try:
                    out[k].append(PeerEntry(owner, PeerRecord.parse_obj(item.value), item.expiration_time))
                except pydantic.ValidationError:
                    logger.warning("ignoring a malformed record under %s", self.stage_key(k))
        return out

    # ---- run config ----

    def publish_config(self, config_json: str, ttl: float) -> bool:
        return self._store(self.key("config"), self.owner, config_json, get_dht_time() + ttl)

    def get_config_json(self) -> str | None:
        found = self._get(self.key("config"))
        if found is None or not isinstance(found.value, dict) or not found.value:
            return None
        items = sorted(found.value.items(), key=lambda kv: -kv[1].expiration_time)
        if len({item.value for _, item in items}) > 1:
            logger.warning("several run configs are published under %s; using the freshest", self.key("config"))
        return items[0][1].value

    # ---- events ----

    def publish_events(self, events: list[str], ttl: float) -> bool:
        record = EventRecord(events=events[-16:])
        return self._store(self.key("events"), self.owner, record.dict(), get_dht_time() + ttl)

    def get_events(self) -> list[str]:
        found = self._get(self.key("events"))
        if found is None or not isinstance(found.value, dict):
            return []
        events: list[str] = []
        for _, item in found.value.items():
            try:
                events.extend(EventRecord.parse_obj(item.value).events)
            except pydantic.ValidationError:
                continue
        return events

    def shutdown(self) -> None:
        try:
            self.dht.shutdown()
        except Exception:  # noqa: BLE001 - shutting down anyway
            logger.debug("DHT shutdown raised", exc_info=True)


class Announcer:
    """Refreshes a record in the background every `period` seconds (TTL = `ttl`), like Petals' announcer.

    `stop()` stores the final (offline) record once, explicitly, so that readers need not wait for
    the TTL to learn that the peer left.
    """

    def __init__(self, publish: Callable[[float], bool], period: float, ttl: float, name: str = "announcer") -> None:
        self.publish, self.period, self.ttl = publish, period, ttl
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.last_ok: float | None = None

    def start(self) -> Announcer:
        self._thread.start()
        return self

    def refresh_now(self) -> None:
        self._wake.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                if self.publish(self.ttl):
                    self.last_ok = time.monotonic()
                else:
                    logger.warning("DHT store was rejected")
            except Exception as e:  # noqa: BLE001 - keep announcing through transient errors
                logger.warning("announce failed: %s", e)
            self._wake.wait(self.period)
            self._wake.clear()

    def stop(self, final: Callable[[], object] | None = None) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=self.period + 5)
        if final is not None:
            try:
                final()
            except Exception as e:  # noqa: BLE001
                logger.warning("final announce failed: %s", e)
