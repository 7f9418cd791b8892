"""Fuzz targets for everything a peer parses from the outside: wire tensors, request messages, every
RPC handler of a real in-process `StageService`, DHT records, training states and checkpoints,
chunked blobs and ledger lines.

A target is a hypothesis strategy of cases and a check that states the contract: only the documented
typed errors escape, no case runs past its deadline, and memory stays within the declared limits
(tests/fuzz/harness.py). `scripts/fuzz.py` runs them for as many cases as asked (docs/FUZZING.md);
`tests/unit/test_fuzz_quick.py` runs a short pass of each in the test suite.
"""
