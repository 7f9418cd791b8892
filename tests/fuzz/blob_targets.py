"""Fuzz targets of chunked blobs and ledger lines: `swarm.wire.blob.receive_blob` (GetState,
GetPartialGradient and GetLedger answers, read by peers, trainers and `swarm ledger`) followed by
`swarm.peer.partials.decode_partial`; `LedgerEntry.from_json` and `StageLedger.load_state`.

Cases: blob streams as `blob_chunks` sends them (random data in random chunk sizes, with or without a
checksum, partial-gradient header fields), then cut, repeated, reordered or mutated; headers that are
any JSON (deep, huge numbers, NaN, not an object); random messages. Ledger lines near a real entry
with fields replaced by any JSON, deep JSON, mutated lines.

Contract: receive_blob raises only StateError, and what it returns is whole (the announced size, at
most the limit, the checksum when there is one); decode_partial raises only StateError and returns
finite gradients shaped as the parameters. from_json raises only ValueError, KeyError, TypeError or
IndexError (what its callers catch: swarm/peer/ledger.py, swarm/cluster/ledger.py), and an entry it
returns has the declared types and survives to_json; load_state never raises.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import json
import math
import random

import torch
from hypothesis import strategies as st

from swarm.core.checks import all_finite
from swarm.core.errors import StateError
from swarm.peer.ledger import StageLedger
from swarm.peer.partials import decode_partial
from swarm.policy.ledger import Held, LedgerEntry
from swarm.wire.blob import receive_blob
from swarm.wire.protocol import pb
from tests.fuzz import strategies as fs
from tests.fuzz.harness import Target
from tests.fuzz.wire_targets import expect

PARAMS = [torch.zeros(3, 4), torch.zeros(5)]  # a stage's parameters, for decode_partial (17 values)
STEP = 3
HEADER_FIELDS = ({}, {"step": STEP, "samples": 4, "dtype": "bfloat16"}, {"step": STEP, "samples": 0})
LIMITS = (0, 16, 40, 4096, 1 << 20)
LEDGER_ERRORS = (ValueError, KeyError, TypeError, IndexError)


# ---- blobs ----


@st.composite
def blob_streams(draw) -> list[bytes]:
    """A blob as `blob_chunks` sends it (header, data in chunks), perhaps damaged."""
    size = draw(st.sampled_from((0, 1, 34, 35, 100, 2000)))
    data = fs.random_bytes(size, draw(st.integers(0, 1 << 20)))
    fields = draw(st.sampled_from(HEADER_FIELDS))
    header = {**fields, "bytes": len(data)}
    if draw(st.booleans()):
        header["sha256"] = hashlib.sha256(data).hexdigest()
    if draw(st.sampled_from(range(4))) == 3:
        header[draw(st.sampled_from(("bytes", "sha256", "step", "samples", "dtype")))] = draw(fs.JSON_VALUES)
    cuts = sorted(draw(st.lists(st.integers(0, size), max_size=3)))
    pieces = [data[a:b] for a, b in zip([0, *cuts], [*cuts, size], strict=True)]
    chunks = [pb.Chunk(header=json.dumps(header).encode()).SerializeToString()]
    chunks += [pb.Chunk(data=p).SerializeToString() for p in pieces if p]
    return draw(fs.mutated_chunks(chunks))


def blob_cases() -> st.SearchStrategy:
    header_text = st.one_of(fs.JSON_VALUES.map(fs.json_text), fs.deep_json(), st.text(max_size=30))
    odd_header = st.tuples(header_text, st.lists(st.binary(max_size=40), max_size=3)).map(
        lambda t: (
            [pb.Chunk(header=t[0].encode("utf-8", "surrogatepass")).SerializeToString()]
            + [pb.Chunk(data=d).SerializeToString() for d in t[1]]
        )
    )
    streams = st.one_of(blob_streams(), blob_streams(), odd_header, st.lists(st.binary(max_size=60), max_size=4))
    return st.tuples(st.just("blob"), streams, st.sampled_from(LIMITS))


async def _receive(chunks: list[bytes], limit: int) -> tuple[dict, bytearray]:
    async def stream():
        for chunk in chunks:
            yield chunk

    # closed here, as a caller closes its call: a refused stream left open is finalized whenever
    # the garbage collector gets to it, e.g. inside a later case's deep json.loads, where the
    # finalizer fails for lack of stack ("Exception ignored in sys.unraisablehook: RecursionError")
    async with contextlib.aclosing(stream()) as opened:
        return await receive_blob(opened, limit, "fuzz")


@functools.cache
def _loop() -> asyncio.AbstractEventLoop:
    return asyncio.new_event_loop()


def check_blob(case: tuple) -> str:
    _, chunks, limit = case
    try:
        header, data = _loop().run_until_complete(_receive(chunks, limit))
    except StateError:
        return "refused"
    expect(isinstance(header, dict), f"receive_blob returned a header that is not a dict\n{header!r}")
    whole = len(data) == header["bytes"] <= limit
    expect(whole, f"receive_blob returned a blob not as announced\n{len(data)}, {header}")
    if "sha256" in header:
        expect(hashlib.sha256(data).hexdigest() == header["sha256"], "a blob that fails its checksum was returned")
    try:
        partial = decode_partial(header, data, PARAMS, STEP)
    except StateError:
        return "received"
    if partial.samples:
        expect(partial.grads is not None and len(partial.grads) == len(PARAMS), "partial sum without gradients")
        shapes = [tuple(g.shape) for g in partial.grads]
        expect(shapes == [tuple(p.shape) for p in PARAMS], f"a partial sum not shaped as the parameters\n{shapes}")
        expect(all(all_finite(g.float()) for g in partial.grads), "a partial sum with NaN or infinity was accepted")
    return "partial sum"


def _derive_chunks(chunks: list[bytes], rng: random.Random) -> list[bytes]:
    chunks = list(chunks)
    if not chunks or rng.random() < 0.2:
        chunks.insert(rng.randint(0, len(chunks)), fs.random_bytes(rng.randrange(40), rng.randrange(1 << 30)))
    else:
        i = rng.randrange(len(chunks))
        chunks[i] = fs.derive_bytes(chunks[i], rng)
    return chunks


def derive_blob(case: tuple, rng: random.Random) -> tuple:
    return ("blob", _derive_chunks(case[1], rng), case[2])


def blob_corpus() -> list:
    deep = [pb.Chunk(header=b"[" * 100_000).SerializeToString()]
    odd = [pb.Chunk(header=b'{"bytes": true}').SerializeToString(), b"\x12\x01x"]
    return [("blob", deep, 1 << 20), ("blob", odd, 16), ("blob", [pb.Chunk(header=b"null").SerializeToString()], 0)]


# ---- ledger lines ----

ENTRY = LedgerEntry(1, 7, {"t0/7/0": Held(4, 123), "t1/7/0#1": Held(2, 1 << 63)}, [("peerA", 0), ("peerB", 2)], 1.5)


@st.composite
def entry_texts(draw) -> str:
    """A ledger line near a real entry: up to three fields replaced by any JSON, or dropped."""
    value = json.loads(ENTRY.to_json())
    for _ in range(draw(st.integers(1, 3))):
        field = draw(st.sampled_from(("stage", "step", "time", "members", "contributions", "extra")))
        if draw(st.sampled_from(range(5))) == 4:
            value.pop(field, None)
        elif field == "contributions" and draw(st.booleans()):
            value[field] = {draw(st.text(max_size=8)): draw(fs.JSON_VALUES)}
        else:
            value[field] = draw(fs.JSON_VALUES)
    return fs.json_text(value)


def ledger_cases() -> st.SearchStrategy:
    mutated = fs.mutated(st.just(ENTRY.to_json().encode())).map(lambda b: b.decode("utf-8", "replace"))
    line = st.one_of(entry_texts(), fs.deep_json(), fs.JSON_VALUES.map(fs.json_text), mutated)
    return st.one_of(st.tuples(st.just("line"), line), st.tuples(st.just("lines"), st.lists(line, max_size=4)))


def _check_entry(entry: LedgerEntry) -> None:
    expect(all(isinstance(x, int) for x in (entry.stage, entry.step)), "stage or step not an int")
    expect(isinstance(entry.time, float), "time is not a float")
    for cid, held in entry.contributions.items():
        expect(isinstance(cid, str) and isinstance(held.samples, int) and isinstance(held.digest, int), "contribution")
    expect(all(isinstance(p, str) and isinstance(e, int) for p, e in entry.members), "members")
    again = LedgerEntry.from_json(entry.to_json())
    same_time = again.time == round(entry.time, 3) or math.isnan(entry.time)
    same = (again.stage, again.step, again.members) == (entry.stage, entry.step, entry.members)
    expect(same_time and same, "an entry does not survive to_json and from_json")
    expect(again.contributions == entry.contributions, "an entry does not survive to_json and from_json")


def check_ledger(case: tuple) -> str:
    if case[0] == "lines":
        ledger = StageLedger(ENTRY.stage)
        ledger.load_state(case[1])
        expect(all(e.stage == ENTRY.stage for e in ledger.entries()), "an entry of another stage was loaded")
        return f"loaded {min(len(ledger), 2)}"
    try:
        entry = LedgerEntry.from_json(case[1])
    except LEDGER_ERRORS:
        return "refused"
    _check_entry(entry)
    return "parsed"


def _derive_line(line: str, rng: random.Random) -> str:
    return fs.derive_bytes(line.encode("utf-8", "surrogatepass"), rng).decode("utf-8", "replace")


def derive_ledger(case: tuple, rng: random.Random) -> tuple | None:
    if case[0] == "line":
        return ("line", _derive_line(case[1], rng))
    if not case[1]:
        return None
    lines = list(case[1])
    i = rng.randrange(len(lines))
    lines[i] = _derive_line(lines[i], rng)
    return ("lines", lines)


def ledger_corpus() -> list:
    return [
        ("line", '{"stage":0,"step":0,"contributions":[]}'),  # contributions that are not an object
        ("line", '{"stage":1e999,"step":0,"contributions":{}}'),  # an infinite stage
        ("line", "[" * 100_000),  # deeper than Python's recursion limit
        ("lines", ['{"stage":1,"step":0,"contributions":"x"}']),
    ]


TARGETS = (
    Target("blob", blob_cases, check_blob, weight=16, corpus=blob_corpus, fanout=4, derive=derive_blob),
    Target("ledger", ledger_cases, check_ledger, weight=17, corpus=ledger_corpus, fanout=4, derive=derive_ledger),
)
