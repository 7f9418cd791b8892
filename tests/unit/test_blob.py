"""Chunked blobs (swarm.wire.blob): a blob arrives whole or is refused with a StateError."""

import asyncio

import pytest

from swarm.core.errors import StateError
from swarm.wire.blob import blob_chunks, receive_blob
from swarm.wire.protocol import pb


def _receive(chunks: list[bytes], limit: int = 1 << 20):
    async def stream():
        for chunk in chunks:
            yield chunk

    return asyncio.run(receive_blob(stream(), limit, "test"))


def test_a_blob_arrives_whole():
    async def sent():
        return [c async for c in blob_chunks(b"x" * 3000, stage=2)]

    header, data = _receive(asyncio.run(sent()))
    assert bytes(data) == b"x" * 3000 and header["stage"] == 2


@pytest.mark.parametrize(
    "header, match",
    [
        # found by the fuzzer (docs/FUZZING.md): a header that is JSON but not an object raised
        # AttributeError, one nested deeper than the recursion limit RecursionError
        (b"null", "not an object"),
        (b"[]", "not an object"),
        (b"3", "not an object"),
        (b"[" * 100_000, "not JSON"),
        (b'{"bytes": "many"}', "announces"),
        (b'{"bytes": 4096}', "limit 16"),
    ],
)
def test_bad_headers_are_refused_with_a_state_error(header, match):
    with pytest.raises(StateError, match=match):
        _receive([pb.Chunk(header=header).SerializeToString()], limit=16)
