"""A peer's ledger of its stage: every applied update and the contributions it holds
(swarm.policy.ledger). It travels with the stage's state (state downloads and checkpoints carry the
newest entries), is served over gRPC (GetLedger) to trainers (which release the gradients they held
once the stage's ledger shows them applied) and to `swarm ledger`, and with --ledger-dir is also
appended to a JSON-lines file per peer and stage.

Written on the compute thread (with the update), read from the event loop: entries are appended
whole and never changed."""

from __future__ import annotations

import logging
import threading
from pathlib import Path

from swarm.policy.ledger import LedgerEntry

logger = logging.getLogger(__name__)

LEDGER_MEMORY_STEPS = 1 << 16  # entries kept in memory (the file keeps everything)
LEDGER_STATE_STEPS = 4096  # entries a state download or checkpoint carries


class StageLedger:
    def __init__(self, stage: int, path: Path | None = None) -> None:
        self.stage = stage
        self.path = path
        self._entries: dict[int, LedgerEntry] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def record(self, entry: LedgerEntry) -> None:
        with self._lock:
            self._entries[entry.step] = entry
            while len(self._entries) > LEDGER_MEMORY_STEPS:
                del self._entries[min(self._entries)]
        if self.path is not None:
            try:
                with open(self.path, "a") as f:
                    f.write(entry.to_json() + "\n")
            except OSError as e:  # the in-memory ledger still has it
                logger.warning("cannot append to the ledger file %s: %s", self.path, e)

    def entries(self, from_step: int = 0, max_steps: int | None = None) -> list[LedgerEntry]:
        with self._lock:
            steps = sorted(s for s in self._entries if s >= from_step)
            if max_steps is not None:
                steps = steps[:max_steps]
            return [self._entries[s] for s in steps]

    def get(self, step: int) -> LedgerEntry | None:
        with self._lock:
            return self._entries.get(step)

    def to_state(self) -> list[str]:
        """The newest entries, as JSON lines, for a state download or checkpoint."""
        with self._lock:
            steps = sorted(self._entries)[-LEDGER_STATE_STEPS:]
            return [self._entries[s].to_json() for s in steps]

    def load_state(self, lines: list[str]) -> None:
        """Adopt a downloaded state's entries (they replace this peer's for the same steps: the state
        holds those updates)."""
        loaded = []
        for line in lines:
            try:
                loaded.append(LedgerEntry.from_json(line))
            except (ValueError, KeyError, TypeError, IndexError) as e:
                logger.warning("ignoring a malformed ledger entry in a state: %s", e)
        with self._lock:
            for entry in loaded:
                if entry.stage == self.stage:
                    self._entries[entry.step] = entry
        if self.path is not None and loaded:
            try:
                with open(self.path, "a") as f:
                    f.writelines(e.to_json() + "\n" for e in loaded if e.stage == self.stage)
            except OSError as e:
                logger.warning("cannot append to the ledger file %s: %s", self.path, e)
