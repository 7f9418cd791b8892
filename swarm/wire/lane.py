"""The lane: Forward and Backward over a plain TCP connection beside the gRPC port.

Why: Python gRPC has a floor. A bare grpc.aio echo of 16 MiB reaches 0.30-0.33 of a raw socket on
this project's test machine, and a 64 KiB echo takes 0.6-0.7 ms; through a peer, the Forward path
stood at 0.37-0.41 and 1.2-1.4 ms. The lane carries the streamed form's messages (swarm.wire.stream:
a header chunk, then the tensors' raw part buffers) in one frame each way. It reads them straight
into buffers and sends them from memory with `loop.sock_*`, so nothing is copied beyond the kernel.

Frame: a fixed header, the segment lengths, the segments.

    magic "SWL1" | kind u8 | flags u8 | status u16 | call id u64 | segment count u16   (18 bytes)
    segment count x u64 lengths
    segments

A request (kind 1 forward, 2 backward) carries the header Chunk as segment 0, then the part
buffers. Flag STREAMED: the parts are keyed as a streamed request's (one contribution per part).
Without it, the request is one unary part, keyed as a unary request, so a retry over gRPC finds the
same contribution. A response (the request's kind and call id) has status 0, a Chunk(header=the
response, parts=the output's sample counts) and the output buffers. An error has a gRPC status code
and its details as segment 0; flag RETRY marks an overload worth retrying.

Calls on one connection are multiplexed by call id. A call that times out is given up on the
client; the peer still computes it (the trainer's contribution ids make a replay harmless). Only
open swarms use the lane: a private swarm's calls carry certificates over TLS, through gRPC.
Bounds on the server: frame bytes, segments per frame, connections, and a read deadline for a
frame once it has started.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import socket
import struct
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

logger = logging.getLogger(__name__)

MAGIC = b"SWL1"
HEADER = struct.Struct("!4sBBHQH")
KINDS = {"forward": 1, "backward": 2}
KIND_NAMES = {v: k for k, v in KINDS.items()}
STREAMED = 1  # request flag
RETRY = 1  # error flag
MAX_SEGMENTS = 4096
SMALL_FRAME = 256 << 10  # a frame smaller than this goes out in one send
MAX_CONNECTIONS = 256
READ_BUFFER = 256 << 10  # per connection: small frames are read out of it
CLIENT_READ_TIMEOUT_S = 60.0  # a response frame, once started, must arrive within this

Buffer = bytes | bytearray | memoryview


class LaneFrameError(ConnectionError):
    """A malformed or oversized frame, or a connection closed mid-frame: the connection is closed."""


@dataclass
class Frame:
    kind: int
    flags: int
    status: int
    call_id: int
    segments: list[Buffer]


async def _recv_into(loop: asyncio.AbstractEventLoop, sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = await loop.sock_recv_into(sock, view[got:])
        if n == 0:
            raise LaneFrameError("the connection closed mid-frame")
        got += n


class FrameReader:
    """Reads the frames of one socket. Small reads come out of a buffer (one recv holds a whole small
    frame, or several); a large segment is received straight into its own buffer."""

    def __init__(self, sock: socket.socket, max_bytes: int, read_timeout_s: float) -> None:
        self.sock, self.max_bytes, self.read_timeout_s = sock, max_bytes, read_timeout_s
        self._buf = bytearray(READ_BUFFER)
        self._start = self._end = 0

    async def _fill(self, loop: asyncio.AbstractEventLoop) -> int:
        if self._start == self._end:
            self._start = self._end = 0
        elif self._end == len(self._buf):  # keep what is left, at the front
            left = self._end - self._start
            self._buf[:left] = self._buf[self._start : self._end]
            self._start, self._end = 0, left
        n = await loop.sock_recv_into(self.sock, memoryview(self._buf)[self._end :])
        self._end += n
        return n

    async def _exact(self, loop: asyncio.AbstractEventLoop, n: int) -> bytearray:
        out = bytearray(n)
        have = min(n, self._end - self._start)
        out[:have] = self._buf[self._start : self._start + have]
        self._start += have
        if n - have >= len(self._buf) // 2:
            await _recv_into(loop, self.sock, memoryview(out)[have:])
            return out
        while have < n:
            if await self._fill(loop) == 0:
                raise LaneFrameError("the connection closed mid-frame")
            take = min(n - have, self._end - self._start)
            out[have : have + take] = self._buf[self._start : self._start + take]
            self._start += take
            have += take
        return out

    async def read(self, loop: asyncio.AbstractEventLoop) -> Frame | None:
        """The next frame, or None when the other side closed between frames. Waiting for a frame to
        start has no deadline (an idle connection is fine); the rest of it must come within the read
        deadline."""
        if self._start == self._end and await self._fill(loop) == 0:
            return None
        async with asyncio.timeout(self.read_timeout_s):
            magic, kind, flags, status, call_id, count = HEADER.unpack(await self._exact(loop, HEADER.size))
            if magic != MAGIC:
                raise LaneFrameError(f"not a lane frame (magic {bytes(magic)!r})")
            if count > MAX_SEGMENTS:
                raise LaneFrameError(f"a frame of {count} segments (at most {MAX_SEGMENTS})")
            lengths = struct.unpack(f"!{count}Q", await self._exact(loop, 8 * count))
            if sum(lengths) > self.max_bytes:
                raise LaneFrameError(f"a frame of {sum(lengths)} bytes (the limit is {self.max_bytes})")
            segments: list[Buffer] = [await self._exact(loop, n) for n in lengths]
        return Frame(kind, flags, status, call_id, segments)


async def write_frame(loop: asyncio.AbstractEventLoop, sock: socket.socket, frame: Frame, lock: asyncio.Lock) -> None:
    """Send a frame: small ones in one send, large ones segment by segment from their own memory.
    A send cut off half-way (cancelled) leaves the stream unusable: the caller closes it."""
    segs = frame.segments
    head = HEADER.pack(MAGIC, frame.kind, frame.flags, frame.status, frame.call_id, len(segs))
    head += struct.pack(f"!{len(segs)}Q", *(len(s) for s in segs))
    total = len(head) + sum(len(s) for s in segs)
    async with lock:
        if total <= SMALL_FRAME:
            await loop.sock_sendall(sock, b"".join([head, *segs]))
            return
        await loop.sock_sendall(sock, head)
        for s in segs:
            if len(s):
                await loop.sock_sendall(sock, s)


def _no_delay(sock: socket.socket) -> None:
    sock.setblocking(False)
    with contextlib.suppress(OSError):  # not TCP (tests may use other sockets)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


# ---- the server (a peer) ----

# (kind name, request segments, flags, client) -> (status, response segments, flags)
Handler = Callable[[str, list[Buffer], int, str], Awaitable[tuple[int, list[Buffer], int]]]


class LaneServer:
    def __init__(self, handler: Handler, max_frame_bytes: int, read_timeout_s: float) -> None:
        self.handler, self.max_frame_bytes, self.read_timeout_s = handler, max_frame_bytes, read_timeout_s
        self.calls = 0  # requests answered
        self._sock: socket.socket | None = None
        self._accepting: asyncio.Task | None = None
        self._connections: dict[asyncio.Task, socket.socket] = {}

    async def start(self, host: str, port: int = 0) -> int:
        """Listen on (host, port); returns the port."""
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.create_server((host, port), family=family, backlog=128)
        self._sock.setblocking(False)
        self._accepting = asyncio.create_task(self._accept())
        return self._sock.getsockname()[1]

    async def _accept(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            conn, addr = await loop.sock_accept(self._sock)
            if len(self._connections) >= MAX_CONNECTIONS:
                logger.warning("lane: refusing a connection from %s (%d open)", addr[0], len(self._connections))
                conn.close()
                continue
            _no_delay(conn)
            task = asyncio.create_task(self._serve(conn, f"lane:{addr[0]}:{addr[1]}"))
            self._connections[task] = conn
            task.add_done_callback(lambda t: self._connections.pop(t, None))

    async def _serve(self, conn: socket.socket, client: str) -> None:
        loop = asyncio.get_running_loop()
        lock = asyncio.Lock()
        reader = FrameReader(conn, self.max_frame_bytes, self.read_timeout_s)
        calls: set[asyncio.Task] = set()
        try:
            while True:
                frame = await reader.read(loop)
                if frame is None:
                    return
                if frame.kind not in KIND_NAMES:
                    raise LaneFrameError(f"unknown request kind {frame.kind}")
                task = asyncio.create_task(self._answer(loop, conn, lock, frame, client))
                calls.add(task)
                task.add_done_callback(calls.discard)
        except (LaneFrameError, OSError, TimeoutError) as e:
            logger.debug("lane connection %s closed: %s", client, e)
        finally:
            for task in calls:
                task.cancel()
            conn.close()

    async def _answer(self, loop, conn: socket.socket, lock: asyncio.Lock, frame: Frame, client: str) -> None:
        status, segments, flags = await self.handler(KIND_NAMES[frame.kind], frame.segments, frame.flags, client)
        self.calls += 1
        try:
            await write_frame(loop, conn, Frame(frame.kind, flags, status, frame.call_id, segments), lock)
        except (OSError, asyncio.CancelledError):
            conn.close()  # a half-sent frame: nothing after it could be read
            raise

    async def stop(self) -> None:
        if self._accepting is not None:
            self._accepting.cancel()
        if self._sock is not None:
            self._sock.close()
        tasks = list(self._connections)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


# ---- the client (a trainer) ----


class LaneClient:
    """One connection to one peer's lane, opened on first use and again after it breaks."""

    def __init__(self, host: str, port: int, max_frame_bytes: int) -> None:
        self.host, self.port, self.max_frame_bytes = host, port, max_frame_bytes
        self._sock: socket.socket | None = None
        self._reader: asyncio.Task | None = None
        self._pending: dict[int, asyncio.Future] = {}
        self._ids = itertools.count(1)
        self._write_lock = asyncio.Lock()
        self._connect_lock = asyncio.Lock()

    async def connect(self) -> None:
        """Connect unless connected (ConnectionError / OSError / TimeoutError from the caller's deadline)."""
        async with self._connect_lock:
            if self._sock is not None:
                return
            loop = asyncio.get_running_loop()
            infos = await loop.getaddrinfo(self.host, self.port, type=socket.SOCK_STREAM)
            family, _, _, _, addr = infos[0]
            sock = socket.socket(family, socket.SOCK_STREAM)
            _no_delay(sock)
            try:
                await loop.sock_connect(sock, addr)
            except BaseException:
                sock.close()
                raise
            self._sock = sock
            self._reader = asyncio.create_task(self._read(sock))

    async def call(self, kind: str, segments: Sequence[Buffer], flags: int, timeout: float) -> Frame:
        """Send a request and wait for its answer (TimeoutError past `timeout`; ConnectionError when
        the connection breaks first)."""
        loop = asyncio.get_running_loop()
        async with asyncio.timeout(timeout):
            await self.connect()
            sock, call_id = self._sock, next(self._ids)
            answer = self._pending[call_id] = loop.create_future()
            try:
                try:
                    frame = Frame(KINDS[kind], flags, 0, call_id, list(segments))
                    await write_frame(loop, sock, frame, self._write_lock)
                except BaseException as e:
                    self._pending.pop(call_id, None)
                    self._broken(sock, e)  # a half-sent frame: the stream is unusable
                    raise
                return await answer
            finally:
                self._pending.pop(call_id, None)

    async def _read(self, sock: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        reader = FrameReader(sock, self.max_frame_bytes, CLIENT_READ_TIMEOUT_S)
        try:
            while True:
                frame = await reader.read(loop)
                if frame is None:
                    raise ConnectionResetError("the peer closed the lane connection")
                answer = self._pending.pop(frame.call_id, None)
                if answer is not None and not answer.done():
                    answer.set_result(frame)
        except asyncio.CancelledError:
            self._broken(sock, ConnectionResetError("the lane connection was closed"))
            raise
        except (OSError, TimeoutError) as e:
            self._broken(sock, e if isinstance(e, OSError) else ConnectionResetError(str(e)))

    def _broken(self, sock: socket.socket, error: BaseException) -> None:
        """Fail every call waiting on `sock` and forget it (the next call reconnects)."""
        if self._sock is not sock:
            return
        self._sock = None
        sock.close()
        if not isinstance(error, ConnectionError):
            error = ConnectionResetError(f"lane connection lost: {type(error).__name__}: {error}")
        for call_id, answer in list(self._pending.items()):
            if not answer.done():
                answer.set_exception(error)
            self._pending.pop(call_id, None)

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._reader
        if self._sock is not None:
            self._broken(self._sock, ConnectionResetError("closed"))


__all__ = ["Frame", "LaneClient", "LaneFrameError", "LaneServer", "RETRY", "STREAMED", "FrameReader", "write_frame"]
