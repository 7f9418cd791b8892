"""Up-front checks of what a user typed, run before any process, DHT node or server is started: each
failure is a ConfigError whose one-line message names the problem and the fix (swarm.cli prints it
and exits with code 2).

- `parse_maddrs`: --initial-peers are multiaddrs with an address, a TCP port and a /p2p/ peer id;
- `check_reachable`: at least one of them accepts a TCP connection (an unreachable coordinator is
  found in a second, not by hivemind's "failed to connect to bootstrap peers" after its start-up);
- `check_port_free`: a fixed --port is not taken by another process on this host;
- `check_writable_dir`: a folder the process will write (checkpoints, ledgers, identities) can be
  created and written.
"""

from __future__ import annotations

import errno
import os
import socket
import tempfile
import threading
from dataclasses import dataclass

from swarm.core.errors import ConfigError

CONNECT_TIMEOUT_S = 3.0


@dataclass(frozen=True)
class DialTarget:
    """Where a multiaddr points: host, TCP port and the peer id."""

    maddr: str
    host: str
    port: int
    peer_id: str


def parse_maddr(text: str, flag: str = "--initial-peers") -> DialTarget:
    """One multiaddr such as /ip4/203.0.113.10/tcp/7001/p2p/12D3KooW..., or a ConfigError saying what is wrong."""
    from hivemind.utils.multiaddr import Multiaddr

    example = "/ip4/203.0.113.10/tcp/7001/p2p/12D3KooW... (the coordinator prints it)"
    try:
        maddr = Multiaddr(text)
    except Exception as e:  # noqa: BLE001 - multiaddr raises several types for malformed text
        raise ConfigError(f"{flag} {text!r} is not a multiaddr ({e}): expected {example}") from None
    protocols = {p.name for p in maddr.protocols()}
    host_proto = next((p for p in ("ip4", "ip6", "dns", "dns4", "dns6") if p in protocols), None)
    if host_proto is None or "tcp" not in protocols or "p2p" not in protocols:
        raise ConfigError(f"{flag} {text!r} needs an address, a TCP port and a /p2p/ peer id: expected {example}")
    return DialTarget(text, maddr.value_for_protocol(host_proto), int(maddr.value_for_protocol("tcp")),
                      maddr.value_for_protocol("p2p"))  # fmt: skip


def parse_maddrs(texts: list[str], flag: str = "--initial-peers") -> list[DialTarget]:
    if not texts:
        raise ConfigError(f"give {flag} MULTIADDR... (the coordinator prints them) or --initial-peers-file PATH")
    return [parse_maddr(t, flag) for t in texts]


def tcp_connect_error(host: str, port: int, timeout_s: float = CONNECT_TIMEOUT_S) -> str | None:
    """None if a TCP connection to host:port opens within the timeout, else why not (a few words)."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return None
    except TimeoutError:
        return f"no answer within {timeout_s:.0f} s"
    except OSError as e:
        return os.strerror(e.errno).lower() if e.errno else str(e)


def check_reachable(targets: list[DialTarget], timeout_s: float = CONNECT_TIMEOUT_S, flag: str = "--initial-peers"):
    """ConfigError unless at least one target accepts a TCP connection (all are tried at once)."""
    errors: dict[str, str | None] = {}

    def probe(t: DialTarget) -> None:
        errors[t.maddr] = tcp_connect_error(t.host, t.port, timeout_s)

    threads = [threading.Thread(target=probe, args=(t,), daemon=True) for t in targets]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout_s + 1)
    if any(errors.get(t.maddr, "") is None for t in targets):
        return
    first = targets[0]
    why = errors.get(first.maddr) or "no answer"
    more = f" (and {len(targets) - 1} more)" if len(targets) > 1 else ""
    raise ConfigError(
        f"cannot connect to {flag} {first.host}:{first.port}{more}: {why}: is the coordinator (or the peer) running, "
        "is the address right, and is its port open to this machine?"
    )


def check_port_free(host: str, port: int, flag: str) -> None:
    """ConfigError if a fixed port is taken on this host, or the host is not an address of this machine
    (port 0: any free port; the address is still checked)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise ConfigError(
                    f"{flag} {port} is already in use on {host}: stop what uses it (ss -ltnp 'sport = :{port}') "
                    f"or choose another {flag} (0: any free port)"
                ) from None
            if e.errno == errno.EADDRNOTAVAIL:
                raise ConfigError(
                    f"--host {host} is not an address of this machine: use one of its addresses or 0.0.0.0 "
                    "(and --announce-host for the address others reach it at)"
                ) from None
            raise ConfigError(f"cannot listen on {host}:{port} ({flag}): {e.strerror}") from None


def check_writable_dir(path: str, flag: str) -> None:
    """ConfigError unless `path` is (or can be created as) a folder this process can write into."""
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".swarm-write-check-"):
            pass
    except OSError as e:
        raise ConfigError(
            f"{flag} {path} is not a writable folder ({e.strerror}): create it with write access for this user "
            "or choose another folder"
        ) from None
