"""How `swarm chaos` looks at its swarm: which peer serves which stage (to pick victims), and the live
peers' ledgers at the end.

Without a network lab the chaos process asks directly. In a lab (--netns) the swarm's addresses exist
only inside the lab's namespaces, so the questions go to an observer process on a lab host of its own
(`python -m swarm.chaos.observer`, one JSON request a line on stdin, one JSON reply a line on stdout),
as an operator's monitoring box would sit on the swarm's network."""

from __future__ import annotations

import asyncio
import json
import logging
import selectors
import subprocess
import sys
import threading

from swarm.wire.client import StageClient

logger = logging.getLogger(__name__)

INFO_TIMEOUT_S = 2.0
REPLY_TIMEOUT_S = 60.0
Answers = dict[str, tuple[int, str] | None]


async def probe_all(addresses: list[str]) -> Answers:
    """(stage, state) each peer answers Info with, or None where it does not answer (all at once)."""

    async def one(address: str) -> tuple[int, str] | None:
        client = StageClient(address)
        try:
            info = await client.info(INFO_TIMEOUT_S)
            return int(info.stage), str(info.state)
        except Exception:  # noqa: BLE001 - not answering is an answer
            return None
        finally:
            await client.close()

    answers = await asyncio.gather(*(one(a) for a in addresses))
    return dict(zip(addresses, answers, strict=True))


async def collect_json(run_id: str, initial_peers: list[str], run_key: str | None, invite: str | None) -> dict:
    from swarm.ledger import collect

    run, entries = await collect(run_id, initial_peers, run_key, invite)
    return {"run": run.to_json(), "entries": [e.to_json() for e in entries]}


class LocalObserver:
    """Asks from this process."""

    def probe(self, addresses: list[str]) -> Answers:
        return asyncio.run(probe_all(addresses)) if addresses else {}

    def collect(self, run_id: str, initial_peers: list[str], run_key: str | None, invite: str | None) -> dict:
        return asyncio.run(collect_json(run_id, initial_peers, run_key, invite))

    def close(self) -> None:
        pass


class LabObserver:
    """Asks through an observer process started with `wrap` (a lab host's `ip netns exec ...`)."""

    def __init__(self, wrap, log_path: str) -> None:
        self._log = open(log_path, "ab")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen(
            wrap([sys.executable, "-m", "swarm.chaos.observer"]),
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True, bufsize=1,
            start_new_session=True,
        )  # fmt: skip
        self._lock = threading.Lock()

    def _ask(self, request: dict) -> dict:
        with self._lock:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the chaos observer exited ({self.proc.returncode}); see {self._log.name}")
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
            reply = _readline(self.proc.stdout, REPLY_TIMEOUT_S)
        if reply is None:
            raise RuntimeError(f"the chaos observer did not answer {request['op']} in {REPLY_TIMEOUT_S:.0f} s")
        answer = json.loads(reply)
        if "error" in answer:
            raise RuntimeError(answer["error"])
        return answer

    def probe(self, addresses: list[str]) -> Answers:
        if not addresses:
            return {}
        answers = self._ask({"op": "probe", "addresses": addresses})["answers"]
        return {a: (tuple(v) if v is not None else None) for a, v in answers.items()}

    def collect(self, run_id: str, initial_peers: list[str], run_key: str | None, invite: str | None) -> dict:
        request = {"run_id": run_id, "initial_peers": initial_peers, "run_key": run_key, "invite": invite}
        return self._ask({"op": "collect", **request})

    def close(self) -> None:
        try:
            self.proc.stdin.close()  # EOF: it exits
            self.proc.wait(timeout=10)
        except Exception:  # noqa: BLE001 - killed below
            self.proc.kill()
            self.proc.wait(timeout=10)
        self._log.close()


def _readline(stream, timeout_s: float) -> str | None:
    with selectors.DefaultSelector() as sel:
        sel.register(stream, selectors.EVENT_READ)
        return stream.readline() if sel.select(timeout_s) else None


def _serve() -> int:
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            request = json.loads(line)
            op = request.pop("op")
            if op == "probe":
                reply = {"answers": asyncio.run(probe_all(list(request["addresses"])))}
            elif op == "collect":
                reply = asyncio.run(collect_json(**request))
            else:
                reply = {"error": f"unknown op {op!r}"}
        except Exception as e:  # noqa: BLE001 - the caller gets the error
            reply = {"error": f"{type(e).__name__}: {e}"}
        print(json.dumps(reply), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(_serve())
