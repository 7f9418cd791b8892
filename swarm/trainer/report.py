"""What a trainer tells its user and its scripts: counters (`Stats`), a progress line per global
step (a parseable JSON line with --json-progress, a bar on a terminal) and the final summary."""

from __future__ import annotations

import collections
import json
import logging
import math
import time
from dataclasses import dataclass, field

from swarm.core.log import set_context
from swarm.core.procs import PROGRESS_PREFIX
from swarm.dht.records import TrainerRecord

logger = logging.getLogger(__name__)

MAX_FAILED_PEERS = 12  # peers listed with their failed calls in a trainer's DHT record


@dataclass
class Stats:
    microbatches_started: int = 0
    microbatches_completed: int = 0
    microbatches_requeued: int = 0
    microbatches_rejected: int = 0
    microbatches_cancelled: int = 0  # in flight when the target step was reached
    samples: int = 0
    retries: int = 0
    failed_calls: int = 0
    replays: int = 0
    inputs_left_out: int = 0  # backwards answered from the activations their forward's peer kept, input not sent
    inputs_resent: int = 0  # backwards sent without it to a peer that no longer held them: sent again with it
    # seconds with nothing in flight, held back by the pacing: waiting for the swarm's next step
    # (exact mode: every stage's update; async: beyond the staleness bound)
    idle_s: float = 0.0
    failed_peers: set[str] = field(default_factory=set)
    failed_calls_by_code: collections.Counter[str] = field(default_factory=collections.Counter)
    failures_by_peer: collections.Counter[str] = field(default_factory=collections.Counter)
    calls_by_peer: collections.Counter[str] = field(default_factory=collections.Counter)  # answered calls
    losses_by_step: dict[int, list[tuple[float, int]]] = field(default_factory=lambda: collections.defaultdict(list))
    val_losses: list[tuple[int, float]] = field(default_factory=list)
    # "forward 0", "backward 2"...: [answered calls, seconds from send to answer, the peers' compute
    # seconds and seconds at the peer they reported]: elapsed - at the peer is transfers and both
    # processes' scheduling; at the peer - compute is its queue and handling
    call_times: dict[str, list[float]] = field(default_factory=dict)

    def count_call(self, kind: str, stage: int, elapsed_s: float, compute_s: float, peer_s: float = 0.0) -> None:
        times = self.call_times.setdefault(f"{kind} {stage}", [0, 0.0, 0.0, 0.0])
        times[0] += 1
        times[1] += elapsed_s
        times[2] += compute_s
        times[3] += peer_s

    def call_ms(self) -> dict[str, dict[str, float]]:
        """Per kind and stage: calls, and the mean milliseconds from send to answer, at the peer and of compute."""
        return {
            key: {
                "calls": int(n),
                "elapsed_ms": round(1000 * t / n, 2),
                "peer_ms": round(1000 * p / n, 2),
                "compute_ms": round(1000 * c / n, 2),
            }  # fmt: skip
            for key, (n, t, c, p) in sorted(self.call_times.items())
            if n
        }

    def mean_loss(self, step: int | None) -> float | None:
        """The sample-weighted mean training loss of the microbatches of `step`."""
        vals = self.losses_by_step.get(step) or [] if step is not None else []
        return sum(v * n for v, n in vals) / sum(n for _, n in vals) if vals else None


class Reporter:
    """Progress per global step, and the summary at the end."""

    def __init__(self, stats: Stats, trainer_index: int, target: int, json_progress: bool) -> None:
        self.stats, self.trainer_index, self.target, self.json_progress = stats, trainer_index, target, json_progress
        self.t_start = time.monotonic()
        self.bar = None
        self.last_step: int | None = None

    def open_bar(self, start_step: int, stream) -> None:
        from tqdm import tqdm

        self.bar = tqdm(
            total=self.target, initial=start_step, desc=f"trainer {self.trainer_index}", unit="step", file=stream
        )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()

    def samples_per_s(self) -> float:
        return self.stats.samples / max(1e-9, time.monotonic() - self.t_start)

    def progress(self, step: int | None, extra: dict | None = None) -> bool:
        """Report a new global step (with `extra` figures in its line); True when it is one (the
        caller may validate then)."""
        if step is None or step == self.last_step:
            return False
        self.last_step = step
        set_context(step=step)
        loss = self.stats.mean_loss(step - 1)
        line = {
            "event": "progress",
            "trainer": self.trainer_index,
            "step": step,
            "target": self.target,
            "loss": loss,
            "samples": self.stats.samples,
            "samples_per_s": self.samples_per_s(),
            "retries": self.stats.retries,
            **(extra or {}),
        }
        if self.json_progress:
            print(PROGRESS_PREFIX + json.dumps(line), flush=True)
        if self.bar is not None:
            self.bar.n = min(step, self.target)
            sps = f"{line['samples_per_s']:.1f}"
            self.bar.set_postfix(loss=f"{loss:.3f}" if loss is not None else "-", sps=sps, retries=self.stats.retries)
            self.bar.refresh()
        return True

    def record(self, trainer_id: str, in_flight: int, failures: dict[str, int]) -> TrainerRecord:
        """This trainer's metrics as its DHT record (for dashboards: swarm.dashboard)."""
        s = self.stats
        step = self.last_step or 0
        loss = s.mean_loss(step - 1) if step else None
        val = s.val_losses[-1][1] if s.val_losses else None
        top = sorted(failures.items(), key=lambda kv: -kv[1])[:MAX_FAILED_PEERS]
        return TrainerRecord(
            trainer_id=trainer_id,
            step=step,
            loss=None if loss is None or not math.isfinite(loss) else float(loss),
            val_loss=None if val is None or not math.isfinite(val) else float(val),
            samples_per_s=float(self.samples_per_s()),
            in_flight=in_flight,
            retries=s.retries,
            replays=s.replays,
            samples=s.samples,
            failed_peers=[[peer[-12:], int(n)] for peer, n in top],
            time=time.time(),
        )

    def summary(self, steps: int, wall_s: float, train_s: float, val_loss: float | None) -> dict:
        s = self.stats
        seen = sorted(s.losses_by_step)
        return {
            "steps": steps,
            "samples": s.samples,
            "loss_first": s.mean_loss(seen[0] if seen else None),
            "loss_last": s.mean_loss(seen[-1] if seen else None),
            "val_loss": val_loss,
            "samples_per_s": s.samples / max(1e-9, train_s),
            "wall_s": wall_s,
            "peer_failures": len(s.failed_peers),
            "retries": s.retries,
            "failed_calls": s.failed_calls,
            "replays": s.replays,
            "inputs_left_out": s.inputs_left_out,
            "inputs_resent": s.inputs_resent,
            "idle_s": round(s.idle_s, 3),
            "call_ms": s.call_ms(),
            "microbatches_started": s.microbatches_started,
            "microbatches_completed": s.microbatches_completed,
            "microbatches_requeued": s.microbatches_requeued,
            "microbatches_rejected": s.microbatches_rejected,
            "microbatches_cancelled": s.microbatches_cancelled,
            "failed_peer_ids": sorted(s.failed_peers),
            "failed_calls_by_code": dict(s.failed_calls_by_code),
            "val_losses": s.val_losses,
            "trainer_index": self.trainer_index,
            "first_step": seen[0] if seen else None,
        }
