"""The peer's side of the lane (swarm.wire.lane): a request frame is read as the streamed form's
messages and served by the gRPC service's own code (admission, checks, compute, response), so the
two transports cannot drift apart. Errors become the same status codes as over gRPC."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator

from swarm.core.errors import Overloaded
from swarm.peer.requests import decode_targets
from swarm.peer.server import StageService
from swarm.peer.statuses import status_of
from swarm.peer.streaming import StreamedRequest
from swarm.wire.codec import WireError
from swarm.wire.lane import RETRY, STREAMED, Buffer, LaneServer
from swarm.wire.protocol import pb

logger = logging.getLogger(__name__)

MAX_DETAILS = 4096


async def _each(segments: list[Buffer]) -> AsyncIterator[Buffer]:
    for segment in segments:
        yield segment


class LaneService:
    """Answers lane frames with a StageService."""

    def __init__(self, service: StageService) -> None:
        self.service = service
        self.server: LaneServer | None = None

    async def start(self, host: str, port: int) -> int:
        limits = self.service.limits
        self.server = LaneServer(self.answer, limits.max_message_bytes, limits.stream_read_timeout_s)
        return await self.server.start(host, port)

    async def stop(self) -> None:
        if self.server is not None:
            await self.server.stop()

    async def answer(self, kind: str, segments: list[Buffer], flags: int, client: str) -> tuple[int, list, int]:
        service = self.service
        service.serving.in_flight += 1
        try:
            with service.admission.request(client):
                return 0, await self._answer(kind, segments, bool(flags & STREAMED)), 0
        except Exception as e:  # noqa: BLE001 - every error becomes a status; the peer keeps serving
            code, details = status_of(e)
            return code.value[0], [details.encode()[:MAX_DETAILS]], RETRY if isinstance(e, Overloaded) else 0
        finally:
            service.serving.in_flight -= 1

    async def _answer(self, kind: str, segments: list[Buffer], streamed: bool) -> list:
        service = self.service
        acc = {"streamed": streamed, "t0": time.monotonic()}
        request = StreamedRequest(kind, _each(segments), service.limits)
        msg = await request.read_header()
        executor, schema = service.serving.check_target(msg.run_id, msg.stage)
        batch = request.check_tensors(schema)
        if not streamed and len(request.counts) != 1:
            raise WireError(f"a unary lane request comes in one part, not {len(request.counts)}")
        targets = decode_targets(msg, schema, batch, service.limits)
        out, first = [], None
        async for enc in service.compute(kind, msg, executor, schema, targets, request.parts(), acc):
            first = first or enc
            out.append(enc.data)
            if enc.codec == pb.CODEC_INT8_BLOCK:
                out.append(enc.scales)
        response = service.response(kind, msg, executor, acc, first, inline_data=False)
        head = pb.Chunk(header=response.SerializeToString(), parts=acc.get("out_counts", []))
        return [head.SerializeToString(), *out]


__all__ = ["LaneService"]
