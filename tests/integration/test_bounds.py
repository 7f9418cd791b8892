"""Bounded resources under hostile input, on a real peer: a stream header declaring a huge tensor,
a flood of backward requests for far-future steps, 2,000 idle streams, a flood of GetState. After
each, the peer still answers Info within its deadline (2 s) and its RSS has grown by less than
RSS_BOUND_MB (200 MB: the peer holds about 300 MB; the attacks, unbounded, would take gigabytes:
[1, 100000, 100000] float32 alone is 40 GB)."""

import asyncio
import time
from collections import Counter

import grpc
import psutil
import pytest
import torch

from swarm.local import LocalOptions, LocalSwarm
from swarm.peer.serving import Limits
from swarm.wire import codec
from swarm.wire.options import channel_options
from swarm.wire.protocol import pb
from tests.integration.helpers import TINY_GPT, assert_all_reaped, info, run_args

RSS_BOUND_MB = 200
INFO_DEADLINE_S = 2.0
D, T = TINY_GPT["d_model"], TINY_GPT["seq_len"]


@pytest.fixture(scope="module")
def swarm(tmp_path_factory):
    swarm = LocalSwarm(
        LocalOptions(
            stages=2,
            stage_layout=[1, 1],
            run_args=run_args(),
            peer_args=["--stream-read-timeout", "3"],
            log_dir=str(tmp_path_factory.mktemp("bounds")),
        )
    )
    try:
        swarm.start()
        yield swarm
    finally:
        pgids = [p.pgid for p in swarm.all_processes()]
        swarm.stop()
        assert_all_reaped(pgids)


def last_peer(swarm):
    return next(p for p in swarm.peers if p.ready["stage"] == 1)


def rss_mb(proc) -> float:
    return psutil.Process(proc.pid).memory_info().rss / 2**20


def assert_healthy(swarm, before_mb: float) -> None:
    """Info within its deadline, RSS within the bound."""
    peer = last_peer(swarm)
    started = time.monotonic()
    answer = info(peer.ready["address"], timeout=INFO_DEADLINE_S)
    assert answer.state == "online" and time.monotonic() - started < INFO_DEADLINE_S
    grown = rss_mb(peer) - before_mb
    assert grown < RSS_BOUND_MB, f"RSS grew by {grown:.0f} MB"


async def _channel(address: str, own_connection: bool = False):
    """A channel to `address`; `own_connection`: not shared with this process's other channels to it
    (gRPC otherwise multiplexes them on one connection, one client to the peer's per-client bound)."""
    options = channel_options(64 << 20) + ([("grpc.use_local_subchannel_pool", 1)] if own_connection else [])
    return grpc.aio.insecure_channel(address, options=options)


def test_huge_shape_header_is_refused_before_any_allocation(swarm):
    peer = last_peer(swarm)
    before = rss_mb(peer)
    header = pb.BackwardRequest(request_id="huge", run_id=swarm.run_id, stage=1, step=0)
    header.input.dtype, header.input.codec = "float32", pb.CODEC_NONE
    header.input.shape[:] = [1, 100_000, 100_000]
    first = pb.Chunk(header=header.SerializeToString(), parts=[1]).SerializeToString()

    async def go():
        async with await _channel(peer.ready["address"]) as channel:
            call = channel.stream_stream("/swarm.Stage/BackwardStream")(iter([first]), timeout=20)
            with pytest.raises(grpc.aio.AioRpcError) as e:
                async for _ in call:
                    pass
            return e.value.code(), e.value.details()

    code, details = asyncio.run(go())
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "elements" in details, details
    assert_healthy(swarm, before)


def test_a_flood_of_future_step_tags_allocates_nothing(swarm):
    peer = last_peer(swarm)
    before = rss_mb(peer)
    step = info(peer.ready["address"]).step
    x = codec.tensor_to_proto(torch.randn(2, T, D), pb.CODEC_NONE)
    y = codec.tensor_to_proto(torch.randint(0, 256, (2, T)), pb.CODEC_NONE)

    async def go():
        async with await _channel(peer.ready["address"]) as channel:
            backward = channel.unary_unary("/swarm.Stage/Backward")
            codes = []
            for tag in range(step + 10, step + 510):
                req = pb.BackwardRequest(request_id=f"f{tag}", run_id=swarm.run_id, stage=1, step=tag, num_samples=2)
                req.input.CopyFrom(x)
                req.targets.CopyFrom(y)
                try:
                    await backward(req.SerializeToString(), timeout=10)
                    codes.append(grpc.StatusCode.OK)
                except grpc.aio.AioRpcError as e:
                    codes.append(e.code())
            return codes

    codes = asyncio.run(go())
    # refused, every one: "the stage is behind that step, try later" (ABORTED, swarm.core.errors.
    # StageBehind: a stage restored from an older checkpoint must not make trainers drop microbatches)
    assert set(codes) == {grpc.StatusCode.ABORTED}, set(codes)
    assert info(peer.ready["address"]).samples_accumulated == 0
    assert_healthy(swarm, before)


def test_two_thousand_idle_streams_leave_info_answering_and_are_cut(swarm):
    peer = last_peer(swarm)
    before = rss_mb(peer)

    async def idle_requests(stop: asyncio.Event):
        await stop.wait()
        if False:  # pragma: no cover - an async generator that sends nothing until stopped
            yield b""

    async def go():
        stop = asyncio.Event()
        # 20 connections of 100 streams: the per-connection bound (64 in flight) admits 1280, so the
        # peer's bound on streams open at once (256) is the one that refuses
        channels = [await _channel(peer.ready["address"], own_connection=True) for _ in range(20)]
        calls = [
            ch.stream_stream("/swarm.Stage/ForwardStream")(idle_requests(stop), timeout=30)
            for ch in channels
            for _ in range(100)
        ]

        async def outcome(call):
            try:
                async for _ in call:
                    pass
                return grpc.StatusCode.OK
            except grpc.aio.AioRpcError as e:
                return e.code()

        waiting = [asyncio.ensure_future(outcome(c)) for c in calls]
        # the flood is in: every stream refused, or open (at most the bound, 256, still pending). Was a
        # 1 s sleep: in a full suite on 2 cores the flood outlasted it, and the Info probe below, sent
        # into the middle of 2000 stream openings, waited over 2 s behind them in the peer's event loop
        # (and this test's) once (CANCELLED at the 2 s deadline, 2026-12-07); alone it takes 5 ms
        async with asyncio.timeout(30):
            while sum(not w.done() for w in waiting) > Limits().max_streams:
                await asyncio.sleep(0.05)
        started = time.monotonic()
        async with await _channel(peer.ready["address"]) as fresh:  # a trainer's or a dashboard's channel
            info_call = fresh.unary_unary("/swarm.Stage/Info", response_deserializer=pb.InfoResponse.FromString)
            answer = await info_call(pb.InfoRequest().SerializeToString(), timeout=INFO_DEADLINE_S)
        info_s = time.monotonic() - started
        codes = await asyncio.gather(*waiting)  # the peer cuts idle streams after 3 s
        stop.set()
        for ch in channels:
            await ch.close()
        return answer, info_s, codes

    answer, info_s, codes = asyncio.run(go())
    assert answer.state == "online" and info_s < INFO_DEADLINE_S
    assert len(codes) == 2000 and grpc.StatusCode.OK not in codes
    peak = info(peer.ready["address"]).streams_peak
    print("codes", Counter(c.name for c in codes), "most streams open at once", peak)
    # refused at the bound (RESOURCE_EXHAUSTED), or admitted and cut for sending nothing
    assert grpc.StatusCode.RESOURCE_EXHAUSTED in codes and grpc.StatusCode.INVALID_ARGUMENT in codes
    # and never more than the bound open at once, by the peer's own count. (Was: at least 2000 - 256
    # refused. On a loaded machine opening 2000 streams takes longer than the 3 s idle cut, a cut
    # stream's slot goes to a later one, as it should, and more than 256 are admitted in all.)
    assert peak == 256
    assert_healthy(swarm, before)


def test_a_get_state_flood_is_served_from_one_snapshot_a_few_at_a_time(swarm):
    peer = last_peer(swarm)
    before = rss_mb(peer)
    request = pb.StateRequest(run_id=swarm.run_id, stage=1).SerializeToString()

    async def go():
        async with await _channel(peer.ready["address"]) as channel:
            get_state = channel.unary_stream("/swarm.Stage/GetState")

            async def one():
                try:
                    async for _ in get_state(request, timeout=30):
                        pass
                    return grpc.StatusCode.OK
                except grpc.aio.AioRpcError as e:
                    return e.code()

            return await asyncio.gather(*(one() for _ in range(100)))

    codes = asyncio.run(go())
    assert 1 <= codes.count(grpc.StatusCode.OK) <= 2  # a few at a time, not more often per caller
    assert codes.count(grpc.StatusCode.RESOURCE_EXHAUSTED) >= 98
    assert_healthy(swarm, before)
