"""`swarm local`: a whole swarm on this machine, every role its own OS process on loopback.

Starts a coordinator, then the peers (S x P, or a per-stage layout), then the trainers; shows
progress; prints an aggregate summary; stops everything it started (process groups, so hivemind's
p2pd daemons too) at the end, on Ctrl-C, or on error.

With `netns` (a network profile), every process runs on its own host of a network lab
(swarm.netlab.hosts: a namespace with its own address and a shaped link), listens on that address,
and joins through the coordinator's lab address; the lab goes with the swarm.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from swarm.core.errors import ConfigError
from swarm.core.procs import ManagedProcess
from swarm.core.settings import setting
from swarm.netlab.hosts import LabHosts
from swarm.netlab.system import NetLabError

if TYPE_CHECKING:
    from swarm.dashboard.live import LiveDashboard

logger = logging.getLogger(__name__)


def comma_ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated peer counts such as 3,1,1, got {text!r}") from None


@dataclass
class LocalOptions:
    stages: int = setting(3, "pipeline stages")
    peers_per_stage: int = setting(2, "peers per stage")
    stage_layout: list[int] | None = setting(
        None, "peers per stage, e.g. 3,1,1 (instead of --peers-per-stage)", parse=comma_ints, metavar="N,N,..."
    )
    trainers: int = setting(1, "trainers (each its own process and data shard)")
    steps: int = setting(60, "optimizer steps to train")
    run_id: str | None = setting(None, "run id (default: random)")
    host: str = setting("127.0.0.1", "interface every process listens on", cli=False)
    netns: str | None = setting(
        None,
        "run every process in its own network namespace, linked as this profile says: lan, internet, mixed or a "
        "profile file (root only; docs/NETWORKS.md)",
        metavar="PROFILE",
    )
    netns_seed: int = setting(0, "seed of the network profile's draws (delays, slow hosts)")
    log_dir: str | None = setting(None, "per-process logs (default runs/RUN_ID)")
    # torch threads per process: many processes share this machine's cores
    threads: int = setting(1, "torch threads per process")
    startup_timeout_s: float = setting(120.0, "longest wait for a process to be ready")
    run_args: list[str] = setting(factory=list, help="passed to the coordinator (run config)", cli=False)
    peer_args: list[str] = setting(factory=list, help="extra arguments for every peer", cli=False)
    trainer_args: list[str] = setting(factory=list, help="extra arguments for every trainer", cli=False)
    python: str = setting(sys.executable, "the Python that runs the processes", cli=False)
    dashboard_port: int | None = setting(
        None, "also serve the dashboard (read-only) on this port of 127.0.0.1 (0: any free port)"
    )
    env: dict[str, str] = setting(factory=dict, help="extra environment for every process", cli=False)
    private: bool = setting(False, "a private swarm: every process joins with the coordinator's invitation")
    tls: bool = setting(True, "private: the gRPC over TLS (--no-tls: plaintext, still authenticated)")

    def layout(self) -> list[int]:
        layout = self.stage_layout or [self.peers_per_stage] * self.stages
        if len(layout) != self.stages:
            raise ConfigError(
                f"--stage-layout {','.join(map(str, layout))} has {len(layout)} entries for {self.stages} stages: "
                "give one count per stage (or leave --stages out)"
            )
        if min(layout) < 1:
            raise ConfigError("every stage needs at least one peer: no 0 in --stage-layout or --peers-per-stage")
        return layout


def aggregate(summaries: list[dict], wall_s: float) -> dict:
    """One summary for the whole run from the trainers' summaries."""

    def mean(key: str) -> float | None:
        vals = [s[key] for s in summaries if s.get(key) is not None]
        return sum(vals) / len(vals) if vals else None

    failed = set()
    for s in summaries:
        failed.update(s.get("failed_peer_ids", []))
    val = next((s["val_loss"] for s in summaries if s.get("val_loss") is not None), None)
    return {
        "steps": max((s["steps"] or 0 for s in summaries), default=0),
        "samples": sum(s["samples"] for s in summaries),
        "loss_first": mean("loss_first"),
        "loss_last": mean("loss_last"),
        "val_loss": val,
        "samples_per_s": sum(s["samples_per_s"] for s in summaries),
        "wall_s": wall_s,
        "peer_failures": len(failed),
        "retries": sum(s["retries"] for s in summaries),
        "replays": sum(s.get("replays", 0) for s in summaries),
        "inputs_left_out": sum(s.get("inputs_left_out", 0) for s in summaries),
        "inputs_resent": sum(s.get("inputs_resent", 0) for s in summaries),
        "microbatches_started": sum(s.get("microbatches_started", 0) for s in summaries),
        "microbatches_completed": sum(s.get("microbatches_completed", 0) for s in summaries),
        "microbatches_requeued": sum(s.get("microbatches_requeued", 0) for s in summaries),
        "microbatches_rejected": sum(s.get("microbatches_rejected", 0) for s in summaries),
        "microbatches_cancelled": sum(s.get("microbatches_cancelled", 0) for s in summaries),
        "failed_calls_by_code": dict(sum((Counter(s.get("failed_calls_by_code", {})) for s in summaries), Counter())),
        "spot_checks": sum(s.get("spot_checks", 0) for s in summaries),
        "spot_check_mismatches": sum(s.get("spot_check_mismatches", 0) for s in summaries),
        "spot_checks_disputed": sum(s.get("spot_checks_disputed", 0) for s in summaries),
        "liars_banned": sorted({p for s in summaries for p in s.get("liars_banned", {})}),
        "spot_check_max_agreeing_error": max([0.0, *(s.get("spot_check_max_agreeing_error", 0.0) for s in summaries)]),
    }


class LocalSwarm:
    """The processes of a local swarm. Use as a context manager: everything is stopped on exit.
    Every process ever started (killed and restarted ones too) is remembered and reaped."""

    def __init__(self, opts: LocalOptions) -> None:
        self.opts = opts
        self.run_id = opts.run_id or f"local-{uuid.uuid4().hex[:8]}"
        self.log_dir = Path(opts.log_dir or Path("runs") / self.run_id)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.coordinator: ManagedProcess | None = None
        self.peers: list[ManagedProcess] = []
        self.trainers: list[ManagedProcess] = []
        self.retired: list[ManagedProcess] = []  # replaced trainers and coordinators
        self.initial_peers: list[str] = []
        self.coordinator_argv: list[str] = []
        self.run_key: str | None = None  # the coordinator's, given to every process that joins
        self.invite: str | None = str(self.log_dir / "invite.json") if opts.private else None
        self._lock = threading.Lock()
        self._counter = 0
        self._trainer_on_line = None
        self.dashboard: LiveDashboard | None = None
        self.lab: LabHosts | None = None
        if opts.netns:
            try:
                self.lab = LabHosts(self.run_id, opts.netns, opts.netns_seed)
            except NetLabError as e:
                raise ConfigError(f"--netns {opts.netns}: {e}") from None

    # ---- process construction ----

    def _cmd(self, role: str, *args: str) -> list[str]:
        return [self.opts.python, "-m", "swarm.cli", role, *args]

    def _env(self) -> dict[str, str]:
        threads = str(self.opts.threads)
        return {"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads, **self.opts.env}

    def _ip(self, slot: str, role: str) -> str:
        """The address the process of this slot listens on: its lab host's, or opts.host."""
        return self.opts.host if self.lab is None else self.lab.host(slot, role).ip

    def _spawn(self, name: str, argv: list[str], on_line=None, slot: str | None = None) -> ManagedProcess:
        if self.lab is not None:
            argv = self.lab.host(slot or name, "peer").wrap(argv)
        proc = ManagedProcess(name, argv, self.log_dir / f"{name}.log", env=self._env(), on_line=on_line)
        logger.debug("started %s (pid %d): %s", name, proc.pid, " ".join(argv))
        return proc

    def join_addresses(self) -> list[str]:
        """Multiaddrs a new process joins the DHT through: the coordinator's while it lives, else
        live peers' (the DHT is everyone's: the swarm goes on without its coordinator)."""
        coordinator_up = self.coordinator is not None and self.coordinator.alive()
        peers = [m for p in self.peers if p.alive() and p.ready for m in p.ready.get("dht_maddrs", [])[:1]]
        return list(self.initial_peers) + peers[:4] if coordinator_up else peers[:4] + list(self.initial_peers)

    def start_coordinator(self, join: list[str] | None = None) -> list[str]:
        """Start the coordinator (again: `join` are the multiaddrs of a running swarm)."""
        if not self.coordinator_argv:
            self.coordinator_argv = self._cmd(
                "coordinator", "--run-id", self.run_id, "--stages", str(self.opts.stages),
                "--host", self._ip("coordinator", "coordinator"),
                "--num-trainers", str(self.opts.trainers), "--run-key-path", str(self.log_dir / "run.key"),
                *(["--private", "--invite-file", self.invite] if self.invite else []),
                *([] if self.opts.tls else ["--no-tls"]), *self.opts.run_args,
            )  # fmt: skip
        argv = self.coordinator_argv + (["--initial-peers", *join] if join else [])
        if self.coordinator is not None:
            self.retired.append(self.coordinator)
        self.coordinator = self._spawn(f"coordinator{len(self.retired) or ''}", argv, slot="coordinator")
        ready = self.coordinator.wait_ready(self.opts.startup_timeout_s)
        self.initial_peers = ready["initial_peers"]
        self.run_key = ready["run_key"]
        return self.initial_peers

    def join_args(self) -> list[str]:
        """What a process needs to join this swarm (run id, key, invitation, DHT addresses)."""
        invite = ["--invite", self.invite] if self.invite else []
        return ["--run-id", self.run_id, "--run-key", self.run_key, *invite, "--initial-peers", *self.join_addresses()]

    def peer_argv(self, stage: int | str, extra: list[str] | None = None, host: str | None = None) -> list[str]:
        return self._cmd(
            "peer", *self.join_args(), "--stage", str(stage),
            "--host", host or self.opts.host, "--threads", str(self.opts.threads), *self.opts.peer_args,
            *(extra or []),
        )  # fmt: skip

    def start_peer(self, stage: int | str, extra: list[str] | None = None, wait: bool = True) -> ManagedProcess:
        with self._lock:
            name = f"peer{self._counter}-s{stage}"
            self._counter += 1
        proc = self._spawn(name, self.peer_argv(stage, extra, self._ip(name, "peer")))
        self.peers.append(proc)
        if wait:
            proc.wait_ready(self.opts.startup_timeout_s)
        return proc

    def start_peers(self, extra: list[str] | None = None) -> list[ManagedProcess]:
        procs = []
        for stage, count in enumerate(self.opts.layout()):
            for _ in range(count):
                procs.append(self.start_peer(stage, extra, wait=False))
        for proc in procs:
            proc.wait_ready(self.opts.startup_timeout_s)
        return procs

    def trainer_argv(self, index: int, host: str | None = None) -> list[str]:
        return self._cmd(
            "trainer", *self.join_args(),
            "--steps", str(self.opts.steps), "--trainer-index", str(index), "--num-trainers", str(self.opts.trainers),
            "--threads", str(self.opts.threads), "--host", host or self.opts.host, "--json-progress",
            "--no-progress-bar", *self.opts.trainer_args,
        )  # fmt: skip

    def start_trainers(self, on_line=None) -> list[ManagedProcess]:
        self._trainer_on_line = on_line
        for index in range(self.opts.trainers):
            argv = self.trainer_argv(index, self._ip(f"trainer{index}", "trainer"))
            self.trainers.append(self._spawn(f"trainer{index}", argv, on_line=on_line, slot=f"trainer{index}"))
        return self.trainers

    def restart_trainer(self, index: int) -> ManagedProcess:
        """Start trainer `index` again (after it died): the same index, so the same contribution ids
        and data shard; it completes what it had started."""
        old = self.trainers[index]
        self.retired.append(old)
        name = f"trainer{index}-r{sum(1 for p in self.retired if p.name.startswith(f'trainer{index}'))}"
        argv = self.trainer_argv(index, self._ip(f"trainer{index}", "trainer"))
        self.trainers[index] = self._spawn(name, argv, on_line=self._trainer_on_line, slot=f"trainer{index}")
        return self.trainers[index]

    def start(self) -> None:
        self.start_coordinator()
        self.start_peers()

    def wait_trainers(self, timeout: float | None = None) -> list[dict]:
        deadline = None if timeout is None else time.monotonic() + timeout
        summaries = []
        for trainer in self.trainers:
            left = None if deadline is None else max(0.1, deadline - time.monotonic())
            code = trainer.wait(timeout=left)
            trainer._reader.join(timeout=5)
            if code != 0 or trainer.summary is None:
                raise RuntimeError(
                    f"{trainer.name} exited with code {code}; log {trainer.log_path}:\n{trainer.log_tail(40)}"
                )
            summaries.append(trainer.summary)
        return summaries

    def all_processes(self) -> list[ManagedProcess]:
        return [p for p in [*self.trainers, *self.peers, self.coordinator, *self.retired] if p is not None]

    def stop(self) -> None:
        if self.dashboard is not None:
            self.dashboard.stop()
            self.dashboard = None
        # clients before servers: a trainer's graceful stop (its last validation, releasing what it holds)
        # needs live peers; stopped together, it waited on dying peers until it was killed
        trainers = [p for p in self.trainers if p is not None]
        _stop_all(trainers)
        _stop_all([p for p in self.all_processes() if p not in trainers])
        if self.lab is not None:
            self.lab.close()  # and every process still in its namespaces

    def __enter__(self) -> LocalSwarm:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _stop_all(procs: list[ManagedProcess], timeout_s: float = 15.0) -> None:
    """Stop these processes at once (SIGTERM, SIGKILL after `timeout_s`), each from its own thread."""
    threads = [threading.Thread(target=p.stop, kwargs={"timeout": timeout_s}) for p in procs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


class ProgressPrinter:
    """Prints the swarm's progress from the trainers' progress lines: one line per few seconds."""

    def __init__(self, total: int, stream=sys.stderr, interval: float = 2.0) -> None:
        self.total, self.stream, self.interval = total, stream, interval
        self._last = 0.0
        self._state: dict[int, dict] = {}
        self._lock = threading.Lock()
        self.tty = stream.isatty()

    def __call__(self, proc: ManagedProcess, line: str, payload: dict | None) -> None:
        if payload is None or payload.get("event") != "progress":
            return
        with self._lock:
            self._state[payload["trainer"]] = payload
            now = time.monotonic()
            step = min(p["step"] for p in self._state.values())
            if now - self._last < self.interval and step < self.total:
                return
            self._last = now
            losses = [p["loss"] for p in self._state.values() if p.get("loss") is not None]
            sps = sum(p["samples_per_s"] for p in self._state.values())
            retries = sum(p["retries"] for p in self._state.values())
            width = 30
            filled = int(width * min(step, self.total) / max(1, self.total))
            bar = "#" * filled + "." * (width - filled)
            loss = f"{sum(losses) / len(losses):.3f}" if losses else "-"
            text = f"[{bar}] step {step}/{self.total}  loss {loss}  {sps:.1f} samples/s  retries {retries}"
            self.stream.write(("\r" + text) if self.tty else text + "\n")
            self.stream.flush()


def run_local(opts: LocalOptions, as_json: bool = False) -> dict:
    t0 = time.monotonic()
    opts.layout()  # validate before starting anything
    out = sys.stdout
    with LocalSwarm(opts) as swarm:
        maddrs = swarm.start_coordinator()
        print(f"run id: {swarm.run_id}", file=out, flush=True)
        print(f"coordinator: {' '.join(maddrs)}", file=out, flush=True)
        print(f"run key: {swarm.run_key}", file=out, flush=True)
        invite = f" --invite {swarm.invite}" if swarm.invite else ""
        attach = f"--run-id {swarm.run_id} --run-key {swarm.run_key}{invite} --initial-peers {maddrs[0]}"
        print(f"attach from another terminal:  swarm peer {attach}  (or swarm trainer / status / dashboard)", file=out)
        print(f"logs: {swarm.log_dir}/", file=out, flush=True)
        if opts.dashboard_port is not None:
            # imported here: the dashboard's web stack is not needed by every process that imports this
            from swarm.dashboard.live import DashboardConfig, LiveDashboard

            dashboard_cfg = DashboardConfig(port=opts.dashboard_port)
            swarm.dashboard = LiveDashboard(
                swarm.run_id, maddrs, dashboard_cfg, run_key=swarm.run_key, invite=swarm.invite
            )
            swarm.dashboard.start()  # prints "dashboard: URL"
        layout = opts.layout()
        print(
            f"starting {sum(layout)} peers (per stage: {','.join(map(str, layout))}) and {opts.trainers} trainer(s)...",
            file=sys.stderr,
            flush=True,
        )
        swarm.start_peers()
        printer = ProgressPrinter(opts.steps)
        swarm.start_trainers(on_line=printer)
        summaries = swarm.wait_trainers()
        if printer.tty:
            sys.stderr.write("\n")
    # every process has stopped: the peers' counters (their last stdout line) are in
    result = aggregate(summaries, time.monotonic() - t0)
    result["peers"] = [p.counters for p in swarm.peers if p.counters is not None]
    if as_json:
        print(json.dumps(result), file=out, flush=True)
    else:
        print_result(result, out)
    return result


def print_result(result: dict, out) -> None:
    for key, value in result.items():
        if key != "peers":
            print(f"{key:>24}: {value:.4f}" if isinstance(value, float) else f"{key:>24}: {value}", file=out)
    for c in result["peers"]:
        print(
            f"    peer {str(c.get('peer_id'))[-8:]} stage {c.get('stage')}: step {c.get('step')}, "
            f"{c.get('samples_processed', 0)} samples back-propagated ({c.get('predicted_samples', 0)} at predicted "
            f"parameters), {c.get('averaging_rounds', 0)} averaging rounds",
            file=out,
        )
