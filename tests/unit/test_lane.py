"""The lane (swarm.wire.lane): frames over real loopback TCP sockets. Calls are multiplexed and
answered out of order; a malformed, oversized or stalled frame closes only its connection; a broken
connection fails the calls waiting on it, and the next call reconnects."""

import asyncio
import contextlib
import socket
import struct

import pytest

from swarm.wire.lane import HEADER, MAGIC, RETRY, STREAMED, LaneClient, LaneServer

pytestmark = pytest.mark.timeout(60)


async def echo(kind, segments, flags, client):
    """Echo the segments back; a request whose first segment says 'slow' waits, 'fail' errs."""
    first = bytes(segments[0]) if segments else b""
    if first == b"slow":
        await asyncio.sleep(0.3)
    if first == b"fail":
        return 8, [b"busy"], RETRY  # RESOURCE_EXHAUSTED, retry later
    return 0, [kind.encode(), bytes([flags]), *segments], 0


def run(coro):
    return asyncio.run(coro)


@contextlib.asynccontextmanager
async def lane(handler=echo, read_timeout_s=5.0):
    """A LaneServer on loopback and a client of it, both closed at the end."""
    server = LaneServer(handler, 1 << 20, read_timeout_s)
    port = await server.start("127.0.0.1", 0)
    client = LaneClient("127.0.0.1", port, 1 << 20)
    try:
        yield server, port, client
    finally:
        await client.close()
        await server.stop()


def test_calls_are_multiplexed_and_answered_out_of_order():
    async def main():
        async with lane() as (server, _, client):
            big = bytes(range(256)) * 2048  # 512 KiB: sent segment by segment
            slow = asyncio.create_task(client.call("backward", [b"slow"], 0, 5))
            fast = await client.call("forward", [b"x", big], STREAMED, 5)
            assert not slow.done()  # the fast answer overtook the slow one on the same connection
            assert [bytes(s) for s in fast.segments] == [b"forward", bytes([STREAMED]), b"x", big]
            assert (await slow).segments[0] == b"backward"
            error = await client.call("forward", [b"fail"], 0, 5)
            assert (error.status, bytes(error.segments[0]), error.flags) == (8, b"busy", RETRY)
            assert server.calls == 3

    run(main())


def test_a_call_past_its_deadline_times_out_and_the_connection_stays_usable():
    async def main():
        async with lane() as (_, _, client):
            with pytest.raises(TimeoutError):
                await client.call("forward", [b"slow"], 0, 0.05)
            assert (await client.call("forward", [b"ok"], 0, 5)).segments[2] == b"ok"

    run(main())


def _raw_frame(magic=MAGIC, kind=1, count=1, lengths=(3,), body=b"abc"):
    return HEADER.pack(magic, kind, 0, 0, 7, count) + struct.pack(f"!{len(lengths)}Q", *lengths) + body


@pytest.mark.parametrize(
    "frame",
    [
        _raw_frame(magic=b"HTTP"),  # not a lane frame
        _raw_frame(kind=9),  # an unknown request kind
        _raw_frame(lengths=(1 << 30,), body=b""),  # over the frame limit
        _raw_frame(count=60000, lengths=(), body=b""),  # too many segments
        b"SWL",  # cut off inside the header, then stalled
    ],
)
def test_a_bad_frame_closes_its_connection_and_the_server_keeps_serving(frame):
    async def main():
        loop = asyncio.get_running_loop()
        async with lane(read_timeout_s=0.5) as (_, port, client):
            with socket.create_connection(("127.0.0.1", port)) as raw:
                raw.setblocking(False)
                await loop.sock_sendall(raw, frame)
                try:  # closed by the server (reset when it left our bytes unread)
                    assert await asyncio.wait_for(loop.sock_recv(raw, 100), 5) == b""
                except ConnectionResetError:
                    pass
            assert (await client.call("forward", [b"ok"], 0, 5)).segments[2] == b"ok"

    run(main())


def test_a_lost_connection_fails_the_waiting_calls_and_the_next_call_reconnects():
    async def main():
        arrived = asyncio.Event()

        async def handler(kind, segments, flags, client):
            arrived.set()  # the call is on the server: its connection is open
            return await echo(kind, segments, flags, client)

        async with lane(handler) as (server, _, client):
            waiting = asyncio.create_task(client.call("forward", [b"slow"], 0, 5))
            await asyncio.wait_for(arrived.wait(), 5)
            for task in list(server._connections):  # the peer's side of the connection goes away
                task.cancel()
            with pytest.raises(ConnectionError):
                await waiting
            assert (await client.call("forward", [b"again"], 0, 5)).segments[2] == b"again"

    run(main())


def test_no_listener_is_a_connection_error():
    async def main():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]  # bound, not listening: refused
            client = LaneClient("127.0.0.1", port, 1 << 20)
            with pytest.raises(OSError):
                await client.call("forward", [b"x"], 0, 5)

    run(main())


def test_a_private_swarms_client_never_uses_a_lane():
    """Member certificates travel in gRPC metadata over TLS: a private swarm's calls stay on gRPC."""
    from swarm.core.keys import SigningKey
    from swarm.wire.auth import MemberCredentials
    from swarm.wire.client import StageClient

    async def main():
        open_client = StageClient("127.0.0.1:1")
        member = StageClient("127.0.0.1:1", credentials=MemberCredentials(SigningKey.generate()))
        try:
            open_client.set_lane(4242)
            member.set_lane(4242)
            assert open_client.lane is not None and open_client.lane.port == 4242
            assert member.lane is None
            open_client.set_lane(0)  # the peer stopped offering one
            assert open_client.lane is None
        finally:
            await open_client.close()
            await member.close()

    run(main())
