"""One chunked-blob transfer over a server stream: a JSON header (size, optional sha256 and
fields of the caller's), then the bytes in 1 MiB chunks. Used by the state download (GetState, with
a checksum) and by stage-mates' partial gradient sums (GetPartialGradient, without: they only move
a prediction, and TCP checks the bytes)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import AsyncIterator

from swarm.core.errors import StateError
from swarm.wire.protocol import pb

CHUNK_BYTES = 1 << 20


async def blob_chunks(data: bytes, checksum: bool = True, **fields) -> AsyncIterator[bytes]:
    """The messages of a blob: a header (`bytes`, `sha256` unless `checksum` is off, `fields`), then
    the data."""
    header = {**fields, "bytes": len(data)}
    if checksum:
        header["sha256"] = hashlib.sha256(data).hexdigest()
    yield pb.Chunk(header=json.dumps(header).encode()).SerializeToString()
    view = memoryview(data)
    for start in range(0, len(data), CHUNK_BYTES):
        yield pb.Chunk(data=bytes(view[start : start + CHUNK_BYTES])).SerializeToString()


async def receive_blob(stream: AsyncIterator[bytes], max_bytes: int, what: str = "state") -> tuple[dict, bytearray]:
    """Read what `blob_chunks` streams and check it arrived whole (size, and sha256 when the header
    has one). Refuses a header announcing more than `max_bytes` before anything is buffered."""
    header, buf = None, bytearray()
    async for raw in stream:
        try:
            chunk = pb.Chunk.FromString(raw)
        except Exception as e:  # noqa: BLE001 - protobuf raises DecodeError and others
            raise StateError(f"{what} stream carries a malformed chunk: {e}") from None
        if header is None:
            try:
                header = json.loads(chunk.header or b"{}")
            except (ValueError, RecursionError) as e:  # RecursionError: JSON nested too deep
                raise StateError(f"{what} header is not JSON: {e}") from None
            if not isinstance(header, dict):
                raise StateError(f"{what} header is a JSON {type(header).__name__}, not an object")
            if not isinstance(header.get("bytes"), int) or header["bytes"] > max_bytes:
                raise StateError(f"{what} header announces {header.get('bytes')!r:.40} bytes (limit {max_bytes})")
            continue
        buf += chunk.data
        if len(buf) > header["bytes"]:
            raise StateError(f"{what} stream carries more bytes than announced")
    if header is None or len(buf) != header["bytes"]:
        raise StateError(f"{what} stream ended after {len(buf)} of {None if header is None else header['bytes']} bytes")
    if "sha256" in header and hashlib.sha256(buf).hexdigest() != header["sha256"]:
        raise StateError(f"{what} checksum mismatch")
    return header, buf
