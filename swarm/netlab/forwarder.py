"""The userspace switch of a lab: forwards Ethernet frames between host links with delay, jitter and loss.

It owns the data path of the "userspace" backend, used when the kernel has no netem qdisc. NetLab starts it
inside the lab's switch namespace (`ip netns exec SWITCH python -I forwarder.py`), so it must stay a
standalone stdlib-only script: it is run by path, not imported as part of the package.

Every host link ends in the switch namespace as a veth interface. The forwarder opens one AF_PACKET socket per
such interface, learns which MAC lives behind which port, and sends each frame out of the right port (or floods
it) after `delay(in port) + delay(out port)` milliseconds, each end's delay drawn from a normal distribution
around its delay_ms with sigma jitter_ms. Frames of one (in, out) pair are never reordered. Each end drops a
frame with its loss_pct. Bandwidth is not shaped here: tbf qdiscs on the veth interfaces do that in the kernel
(frames sent on a packet socket go through the interface's qdisc).

Sockets use PACKET_VNET_HDR, so GSO super-frames and partial checksums pass through unchanged (no
segmentation in userspace, no broken checksums).

Control protocol, one JSON object a line on stdin, one reply line on stdout:
    {"op": "add", "ifname": "...", "delay_ms": 20, "jitter_ms": 2, "loss_pct": 0.1, "seed": 7}  -> "ok add IFNAME"
        optional "inbound": false: drop TCP connection attempts (SYN without ACK) to that host, as a NAT would
    {"op": "stats"}                                                                                -> "ok stats {...}"
    {"op": "cut", "ifname": "...", "cut": true}  -> "ok cut IFNAME": drop every frame to and from that host (a
        network partition: no reset, no error, packets vanish) until the same command with "cut": false
It exits when stdin reaches EOF (its owner closed the lab or died) or on SIGTERM.
"""

from __future__ import annotations

import heapq
import json
import logging
import os
import random
import selectors
import signal
import socket
import sys
import time
from dataclasses import dataclass, field

log = logging.getLogger("swarm.netlab.forwarder")

ETH_P_ALL = 0x0003
SOL_PACKET = 263
PACKET_VNET_HDR = 15
PACKET_IGNORE_OUTGOING = 23
VNET_HDR_LEN = 10
MAX_FRAME = 65536 + VNET_HDR_LEN + 64
MAX_QUEUED_BYTES = 256 * 1024 * 1024
RECV_BATCH = 256
SOCKET_BUFFER = 8 * 1024 * 1024
MAX_PORTS = 900  # select(2) handles file descriptors below 1024


@dataclass
class Port:
    """One host link as seen from the switch: its socket and the impairments of that link end."""

    ifname: str
    sock: socket.socket
    delay_s: float
    jitter_s: float
    loss: float
    rng: random.Random
    inbound: bool = True  # False: connections to this host are refused on the way (TCP SYN without ACK dropped)
    cut: bool = False  # True: the link is cut, every frame to or from this host is dropped
    sent: int = 0
    dropped: int = 0

    def sample_delay(self) -> float:
        if self.jitter_s <= 0:
            return self.delay_s
        return max(0.0, self.rng.gauss(self.delay_s, self.jitter_s))

    def lost(self) -> bool:
        return self.loss > 0 and self.rng.random() < self.loss


@dataclass
class Switch:
    """Ports, the learned MAC table and the queue of delayed frames."""

    ports: list[Port] = field(default_factory=list)
    macs: dict[bytes, int] = field(default_factory=dict)  # MAC -> port index
    queue: list[tuple[float, int, int, bytes]] = field(default_factory=list)  # (due, seq, port index, frame)
    last_due: dict[tuple[int, int], float] = field(default_factory=dict)
    queued_bytes: int = 0
    seq: int = 0

    def add_port(self, cmd: dict) -> Port:
        sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
        sock.setsockopt(SOL_PACKET, PACKET_VNET_HDR, 1)
        sock.setsockopt(SOL_PACKET, PACKET_IGNORE_OUTGOING, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER)
        sock.bind((cmd["ifname"], ETH_P_ALL))
        sock.setblocking(False)
        port = Port(
            ifname=cmd["ifname"],
            sock=sock,
            delay_s=float(cmd.get("delay_ms") or 0) / 1000,
            jitter_s=float(cmd.get("jitter_ms") or 0) / 1000,
            loss=float(cmd.get("loss_pct") or 0) / 100,
            rng=random.Random(f"{cmd.get('seed', 0)}/{cmd['ifname']}"),
            inbound=bool(cmd.get("inbound", True)),
        )
        self.ports.append(port)
        return port

    def receive(self, index: int) -> None:
        """Drain one port's socket and route every frame."""
        port = self.ports[index]
        for _ in range(RECV_BATCH):
            try:
                frame = port.sock.recv(MAX_FRAME)
            except (BlockingIOError, InterruptedError):
                return
            if len(frame) < VNET_HDR_LEN + 14:
                continue
            dst, src = frame[VNET_HDR_LEN : VNET_HDR_LEN + 6], frame[VNET_HDR_LEN + 6 : VNET_HDR_LEN + 12]
            self.macs[src] = index
            out = self.macs.get(dst)
            if dst[0] & 1 or out is None:
                targets = [i for i in range(len(self.ports)) if i != index]
            else:
                targets = [out] if out != index else []
            for target in targets:
                self.schedule(index, target, frame)

    def schedule(self, src: int, dst: int, frame: bytes) -> None:
        inp, out = self.ports[src], self.ports[dst]
        if inp.cut or out.cut:
            out.dropped += 1
            return
        if not out.inbound and is_tcp_connect(frame):
            out.dropped += 1  # a host behind NAT: nobody can open a connection to it; its own connections work
            return
        if inp.lost() or out.lost() or self.queued_bytes + len(frame) > MAX_QUEUED_BYTES:
            out.dropped += 1
            return
        now = time.monotonic()
        due = max(now + inp.sample_delay() + out.sample_delay(), self.last_due.get((src, dst), 0.0))
        self.last_due[(src, dst)] = due
        if due <= now and not self.queue:
            self.send(dst, frame)
            return
        self.seq += 1
        self.queued_bytes += len(frame)
        heapq.heappush(self.queue, (due, self.seq, dst, frame))

    def flush(self) -> float | None:
        """Send every frame that is due; return seconds until the next one (None: queue empty)."""
        while self.queue:
            now = time.monotonic()
            due = self.queue[0][0]
            if due > now:
                return due - now
            _, _, dst, frame = heapq.heappop(self.queue)
            self.queued_bytes -= len(frame)
            self.send(dst, frame)
        return None

    def send(self, dst: int, frame: bytes) -> None:
        port = self.ports[dst]
        if port.cut:  # cut while the frame was on its way
            port.dropped += 1
            return
        try:
            port.sock.send(frame)
            port.sent += 1
        except OSError:  # ENOBUFS (the link's tbf queue is full), EAGAIN, interface gone: the frame is lost
            port.dropped += 1

    def stats(self) -> dict:
        ports = {p.ifname: {"sent": p.sent, "dropped": p.dropped} for p in self.ports}
        return {"ports": ports, "queued": len(self.queue), "queued_bytes": self.queued_bytes}


def is_tcp_connect(frame: bytes) -> bool:
    """Whether a frame (after the vnet header) is an IPv4 TCP segment opening a connection: SYN set, ACK not."""
    eth = VNET_HDR_LEN
    if len(frame) < eth + 14 + 20 or frame[eth + 12 : eth + 14] != b"\x08\x00":
        return False
    ip = eth + 14
    if frame[ip + 9] != 6:  # not TCP
        return False
    tcp = ip + (frame[ip] & 0x0F) * 4
    return len(frame) > tcp + 13 and frame[tcp + 13] & 0x12 == 0x02


def handle_command(switch: Switch, sel: selectors.BaseSelector, line: str) -> str:
    try:
        cmd = json.loads(line)
        if cmd.get("op") == "add":
            if len(switch.ports) >= MAX_PORTS:
                return f"error at most {MAX_PORTS} ports"
            port = switch.add_port(cmd)
            sel.register(port.sock, selectors.EVENT_READ, len(switch.ports) - 1)
            return f"ok add {port.ifname}"
        if cmd.get("op") == "cut":
            ports = [p for p in switch.ports if p.ifname == cmd["ifname"]]
            if not ports:
                return f"error no port {cmd['ifname']}"
            ports[0].cut = bool(cmd["cut"])
            return f"ok cut {cmd['ifname']}"
        if cmd.get("op") == "stats":
            return "ok stats " + json.dumps(switch.stats())
        return f"error unknown command: {line.strip()}"
    except (OSError, ValueError, KeyError) as e:
        return f"error {type(e).__name__}: {e}"


def serve(control_in: int, control_out) -> None:
    """Run the switch until the control stream reaches EOF."""
    switch = Switch()
    # select(2) takes its timeout in microseconds; epoll and poll round it up to whole milliseconds, which
    # would add up to 1 ms to every delayed frame.
    sel = selectors.SelectSelector()
    os.set_blocking(control_in, False)
    sel.register(control_in, selectors.EVENT_READ, None)
    pending = b""
    while True:
        timeout = switch.flush()
        for key, _ in sel.select(timeout):
            if key.data is not None:
                switch.receive(key.data)
                continue
            try:
                chunk = os.read(control_in, 65536)
            except BlockingIOError:
                continue
            if not chunk:
                return
            pending += chunk
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                control_out.write(handle_command(switch, sel, line.decode()) + "\n")
                control_out.flush()


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s forwarder %(levelname)s %(message)s")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    signal.signal(signal.SIGINT, lambda *_: sys.exit(0))
    try:
        serve(sys.stdin.fileno(), sys.stdout)
    except BrokenPipeError:
        pass
    log.info("control stream closed: exiting")
    return 0


if __name__ == "__main__":
    sys.exit(main())
