"""Gradient averaging among the peers of one stage, with hivemind's all-reduce.

Each peer puts the mean gradient of its own samples into its averager and joins an all-reduce
weighted by its number of samples; every member ends with the sample-weighted mean, i.e. the mean
gradient over all the stage's samples: what one process computes on the whole global batch. A peer
with no samples joins with weight 0 and receives the others' mean.

The all-reduce is hivemind's (`AllReduceRunner`: butterfly all-reduce over libp2p, in the process of a
`DecentralizedAverager`). Its group, however, is not found by hivemind's matchmaking: the peers of a
stage already know each other (the stage's DHT records and their gRPC Info polls), so every peer
derives the same group for update t from the same facts: its live stage-mates, sorted by id, and a
group id hashed from (run, stage, step, attempt, members). That makes a round cost one all-reduce
instead of a matchmaking protocol (DHT declarations, leader election, join requests), and avoids the
race we saw in hivemind 1.1.12's matchmaking on a loaded machine: two peers each asking the other
to lead, both timing out, one of them having counted the other in -- an all-reduce that then waits
for a member who left and returns a silently partial average.

A round is accepted only if it was complete: every part from every member reduced and returned.
Anything less raises AveragingFailed and the caller retries with a fresh view.

One averager per peer process (one hivemind identity per process); it is rebuilt when the peer
moves to another stage, since the averaged tensors have that stage's shapes.
"""

from __future__ import annotations

import asyncio
import functools
import gc
import hashlib
import logging
import multiprocessing
import signal
import threading
import time
from dataclasses import dataclass
from typing import AsyncIterator  # noqa: UP035 - hivemind detects streams by typing's generic name

import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.allreduce import AllReduceRunner
from hivemind.averaging.group_info import GroupInfo
from hivemind.averaging.load_balancing import load_balance_peers
from hivemind.p2p import P2PContext, PeerID
from hivemind.p2p.p2p_daemon_bindings.utils import raise_if_failed, read_pbmsg_safe, write_pbmsg
from hivemind.proto import averaging_pb2
from hivemind.proto import p2pd_pb2 as p2pd_pb
from hivemind.utils import MPFuture
from hivemind.utils.asyncio import achain, as_aiter, azip, enter_asynchronously
from hivemind.utils.multiaddr import Multiaddr

from swarm.core.checks import all_finite
from swarm.core.procs import die_with_parent
from swarm.core.settings import setting

logger = logging.getLogger(__name__)

MAX_MADDR_BYTES = 512
START_TIMEOUT_S = 60.0  # an averager process that is not serving by then is killed: its start failed


class AveragingFailed(RuntimeError):
    pass


def _standard_event_loop() -> asyncio.AbstractEventLoop:
    asyncio.set_event_loop_policy(asyncio.DefaultEventLoopPolicy())
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    return loop


class _StageAverager(DecentralizedAverager):
    """DecentralizedAverager that dies with its peer and runs all-reduce rounds in given groups."""

    group_wait_s: float = 3.0  # how long a member's request waits for us to open the same round

    def __init__(self, *args, **kwargs) -> None:
        # the unix socket address its p2p client listens at, written by its process: the p2p daemon
        # keeps a stream handler under (protocol, that address) until it is removed by that address
        self.client_maddr = multiprocessing.Array("c", MAX_MADDR_BYTES)
        super().__init__(*args, **kwargs)

    async def add_p2p_handlers(self, p2p, wrapper=None, *, namespace=None, balanced=False) -> None:
        """In its process, before the handlers are registered: say under which client address."""
        self.client_maddr.value = str(p2p._client_listen_maddr).encode()[: MAX_MADDR_BYTES - 1]
        await super().add_p2p_handlers(p2p, wrapper, namespace=namespace, balanced=balanced)

    def run(self) -> None:
        die_with_parent()  # a SIGKILLed peer must not leave its averager serving
        # hivemind runs its averager on uvloop; with uvloop 0.2x its p2pd stream server
        # intermittently fails incoming streams ("cannot reuse already awaited coroutine" in
        # client_connected_cb), which drops a member's parts from an all-reduce. The standard
        # asyncio loop does not (in this process only).
        import hivemind.averaging.averager as averager_module

        averager_module.switch_to_uvloop = _standard_event_loop
        super().run()

    async def _shutdown(self, timeout: float | None) -> None:
        """hivemind 1.1.12's _shutdown calls finalize() on the futures of running groups instead of
        on their runners (an AttributeError when a peer stops mid-round); cancel the rounds here."""
        if not self.client_mode:
            await self.remove_p2p_handlers(self._p2p, namespace=self.prefix)
        for future in list(self._running_groups.values()):
            if future.done() and not future.cancelled() and future.exception() is None:
                future.result().finalize(cancel=True)
            elif not future.done():
                future.cancel()

    async def _fixed_group_round(self, group_id: bytes, members: list[bytes], weight: float, future: MPFuture) -> None:
        """Runs in the averager's process (dispatched through its pipe like hivemind's own methods)."""
        try:
            ordered = tuple(PeerID(m) for m in members)
            info = GroupInfo(group_id, ordered, tuple(b"" for _ in ordered))
            kwargs = dict(self.allreduce_kwargs)
            min_vector_size = kwargs.pop("min_vector_size", 0)
            fractions = load_balance_peers(self.total_size, [1.0] * len(ordered), min_vector_size)
            with self._register_allreduce_group(info):
                async with enter_asynchronously(self.get_tensors()) as tensors:
                    runner = AllReduceRunner(
                        p2p=self._p2p,
                        servicer_type=type(self),
                        prefix=self.prefix,
                        tensors=tensors,
                        group_id=group_id,
                        ordered_peer_ids=ordered,
                        peer_fractions=fractions,
                        weight=weight,
                        **kwargs,
                    )
                    self._running_groups[group_id].set_result(runner)

                    async def apply_updates() -> None:
                        async for tensor, update in azip(as_aiter(*tensors), runner):
                            tensor.add_(update)

                    await asyncio.wait_for(apply_updates(), timeout=self._allreduce_timeout)
                    reducer = runner.tensor_part_reducer
                    complete = (
                        runner.tensor_part_container.failed_size == 0
                        and not runner.banned_senders
                        and sum(reducer.num_parts_received) == reducer.num_parts * reducer.num_senders
                    )
            future.set_result(complete)
        except BaseException as e:  # noqa: BLE001 - every failure goes back to the caller
            if not future.done():
                future.set_exception(e)

    async def rpc_aggregate_part(
        self, stream: AsyncIterator[averaging_pb2.AveragingData], context: P2PContext
    ) -> AsyncIterator[averaging_pb2.AveragingData]:
        """A member sends us its part: wait (briefly) for this peer to open the same round, which it
        may do a moment later than the sender, then let the round's runner reduce it."""
        request = await anext(stream)
        deadline = asyncio.get_running_loop().time() + self.group_wait_s
        while request.group_id not in self._running_groups and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.005)
        future = self._running_groups.get(request.group_id)
        if future is None:
            yield averaging_pb2.AveragingData(code=averaging_pb2.BAD_GROUP_ID)
            return
        group = await future
        async for message in group.rpc_aggregate_part(achain(as_aiter(request), stream), context):
            yield message

    def fixed_group_round(self, group_id: bytes, members: list[bytes], weight: float, timeout: float) -> bool:
        future = MPFuture()
        self._outer_pipe.send(
            ("_fixed_group_round", [], dict(group_id=group_id, members=members, weight=weight, future=future))
        )
        return future.result(timeout=timeout)


@dataclass(frozen=True)
class AveragingConfig:
    allreduce_timeout_s: float = setting(
        30.0, "longest a stage's gradient all-reduce may take", flag="--averaging-timeout"
    )
    next_chunk_timeout_s: float = setting(
        5.0,
        "a member silent for this long is left out of an all-reduce round (which then is retried)",
        flag="--averaging-chunk-timeout",
    )
    direct_max_members: int = setting(
        8,
        "a stage of at most this many peers averages by fetching each other's frozen sums over gRPC "
        "instead of hivemind's all-reduce (0: always the all-reduce)",
        flag="--averaging-direct-max",
    )
    shard_min_mb: float = setting(
        4.0,
        "a directly averaged stage of 3 or more peers whose gradient is at least this large (float32, MiB) "
        "averages by reduce-scatter: half the bytes per member, one more round trip (0: always)",
        flag="--averaging-shard-min-mb",
    )

    def __post_init__(self) -> None:
        if not self.shard_min_mb >= 0:
            raise ValueError(f"--averaging-shard-min-mb must be >= 0, got {self.shard_min_mb}")

    @property
    def shard_min_bytes(self) -> int:
        return int(self.shard_min_mb * (1 << 20))


@dataclass
class AveragedGradient:
    mean: list[torch.Tensor]
    members: tuple[str, ...]  # peer ids whose gradients the mean holds
    seconds: float
    straggler_s: float = 0.0  # of `seconds`: waiting for a mate to begin averaging (direct averaging)
    sharded: bool = False  # by reduce-scatter (swarm.peer.direct)


def round_id(prefix: str, step: int, members: list[str]) -> bytes:
    """The same id on every member that sees the same group for the same update (no attempt
    counter: peers that retry at different moments must still meet)."""
    return hashlib.sha256(f"{prefix}|{step}|{','.join(members)}".encode()).digest()[:20]


def _fork_quietly(start) -> None:
    """Fork with the garbage collector off the parent's objects: the child must not finalize them. A
    joining peer's averager process once died at once with a gRPC fatal error ("Check failed:
    next_worker->state == KICKED") 13 ms after the fork, and the peer waited for it for ever; a
    collection in the child that reaches a dead gRPC call's cycle is the likely way it touches gRPC."""
    gc.collect()
    gc.freeze()  # the child never scans what existed at the fork
    try:
        start()
    finally:
        gc.unfreeze()


class StageAverager:
    def __init__(self, dht, run_id: str, stage: int, params: list[torch.Tensor], cfg: AveragingConfig) -> None:
        self.cfg = cfg
        self.prefix = f"{run_id}_stage{stage}_grads"
        self.peer_id, self.dht = str(dht.peer_id), dht
        # hivemind's run_in_background sets SIGINT to SIG_IGN in the calling process: a peer with an
        # averager ignored Ctrl-C, and so did every process it started later (a test worker's too)
        sigint = signal.getsignal(signal.SIGINT)
        try:
            self.averager = _StageAverager(
                [torch.zeros_like(p, device="cpu") for p in params],
                dht,
                prefix=self.prefix,
                start=False,
                allreduce_timeout=cfg.allreduce_timeout_s,
                next_chunk_timeout=cfg.next_chunk_timeout_s,
                allow_state_sharing=False,  # state travels over our gRPC GetState, not hivemind's RPC
            )
        except Exception as e:  # noqa: BLE001 - shared memory, pipes: the stage tries again
            raise AveragingFailed(f"could not create an averager: {e!r}") from None
        try:
            _fork_quietly(lambda: self.averager.run_in_background(await_ready=False))
            self.averager.wait_until_ready(START_TIMEOUT_S)
        except Exception as e:  # noqa: BLE001 - hivemind raises several kinds; the stage tries again
            if self.averager.is_alive():
                self.averager.kill()
                self.averager.join(5.0)
            self.shutdown()  # dead: removes the handlers it may have registered (a replacement needs the names)
            raise AveragingFailed(f"could not start an averager process: {e!r}") from None
        finally:
            if sigint is not None and threading.current_thread() is threading.main_thread():
                signal.signal(signal.SIGINT, sigint)

    @property
    def alive(self) -> bool:
        """Its averager process runs (a child forked while gRPC threads ran can die of it)."""
        return self.averager.is_alive()

    def average(self, grads_sum: list[torch.Tensor], samples: int, step: int, mates: list[str]) -> AveragedGradient:
        """All-reduce this peer's gradient (the gradient of the summed loss over `samples`) with the
        given stage-mates' (their peer ids). Blocking; raises AveragingFailed unless the round was
        complete."""
        if not self.alive:
            raise AveragingFailed(f"averaging for step {step}: this peer's averager process is not running")
        start = time.monotonic()
        members = sorted({self.peer_id, *mates})
        with self.averager.get_tensors() as tensors:
            for buf, g in zip(tensors, grads_sum, strict=True):
                buf.copy_(g.detach().cpu()).div_(max(1, samples))
        group_id = round_id(self.prefix, step, members)
        try:
            complete = self.averager.fixed_group_round(
                group_id,
                [PeerID.from_base58(m).to_bytes() for m in members],
                float(samples),
                timeout=self.cfg.allreduce_timeout_s + 5.0,
            )
        except Exception as e:  # noqa: BLE001 - hivemind raises several kinds; all mean "no average"
            raise AveragingFailed(f"averaging for step {step} failed: {e!r}") from None
        if not complete:
            raise AveragingFailed(f"averaging for step {step} was incomplete (a member did not take part)")
        with self.averager.get_tensors() as tensors:
            mean = [t.detach().clone() for t in tensors]
        if not all(all_finite(t) for t in mean):
            raise AveragingFailed(f"averaged gradient for step {step} is not finite (no member had samples?)")
        return AveragedGradient(mean, tuple(members), time.monotonic() - start)

    def shutdown(self) -> None:
        """Stop the averager process. One that died (killed, or hung and timed out) left its RPC
        handlers registered in the p2p daemon it shares with the DHT, and a replacement could not
        register its own ("handler ... already set"): the peer never averaged again and its stage
        stalled. They are removed here, from the DHT process."""
        if self.averager.is_alive():
            try:
                self.averager.shutdown()
            except Exception:  # noqa: BLE001
                logger.debug("averager shutdown raised", exc_info=True)
            return
        maddr = self.averager.client_maddr.value.decode()
        if maddr:
            try:
                self.dht.run_coroutine(functools.partial(_remove_handlers, prefix=self.prefix, client_maddr=maddr))
            except Exception as e:  # noqa: BLE001 - the replacement's start reports what is left
                logger.warning("could not remove the dead averager's handlers: %s", e)


async def _remove_handlers(_dht, node, prefix: str, client_maddr: str) -> None:
    """In the DHT process: unregister the stream handlers of `prefix` that the averager process whose
    p2p client listened at `client_maddr` left in the p2p daemon they share (hivemind's own removal
    goes through that client, gone with its process)."""
    _StageAverager._collect_rpc_handlers()
    connector = node.p2p._client.control.daemon_connector
    for handler in _StageAverager._rpc_handlers:
        name = _StageAverager._get_handle_name(prefix, handler.method_name)
        request = p2pd_pb.Request(
            type=p2pd_pb.Request.REMOVE_STREAM_HANDLER,
            removeStreamHandler=p2pd_pb.RemoveStreamHandlerRequest(
                addr=Multiaddr(client_maddr).to_bytes(), proto=[name]
            ),
        )
        try:
            reader, writer = await connector.open_connection()
            try:
                await write_pbmsg(writer, request)
                response = p2pd_pb.Response()
                await read_pbmsg_safe(reader, response)
                raise_if_failed(response)
            finally:
                writer.close()
        except Exception as e:  # noqa: BLE001 - one not registered (a unary handler, or removed already)
            logger.debug("removing handler %s: %r", name, e)


def local_mean(grads_sum: list[torch.Tensor], samples: int) -> list[torch.Tensor]:
    return [g / max(1, samples) for g in grads_sum]
