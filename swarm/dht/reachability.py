"""Dial-back: is this process reachable from outside? A process asks another DHT node (the coordinator, or any
peer) to open TCP connections to the addresses it announces, and learns the address it is seen from.

Every non-client SwarmDHT node serves `swarm.dialback` on its libp2p host (in hivemind's DHT process). A request
holds up to MAX_TARGETS "host:port" addresses; the server dials only those whose host is the address the
requester's own connection comes from (so the service cannot be used to probe third parties), each with a short
timeout, and answers, per address, None (connected) or why not, plus the requester's observed addresses. A peer
behind NAT that announces its private address learns that it is seen from another one; one that announces its
public address without forwarding the ports learns that the connection timed out.
"""

from __future__ import annotations

import asyncio
import functools
import ipaddress
import json
import logging

from google.protobuf.wrappers_pb2 import BytesValue

logger = logging.getLogger(__name__)

HANDLER = "swarm.dialback"
MAX_TARGETS = 4
DIAL_TIMEOUT_S = 3.0


def _observed_hosts(addrs) -> list[str]:
    hosts = []
    for addr in addrs:
        for proto in ("ip4", "ip6"):
            try:
                hosts.append(addr.value_for_protocol(proto))
            except Exception:  # noqa: BLE001 - multiaddr raises when the protocol is absent
                continue
    return sorted(set(hosts))


async def _dial(host: str, port: int) -> str | None:
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), DIAL_TIMEOUT_S)
    except TimeoutError:
        return f"no answer within {DIAL_TIMEOUT_S:.0f} s (a NAT or firewall drops connections)"
    except OSError as e:
        return e.strerror or str(e)
    writer.close()
    return None


def _split(target: str) -> tuple[str, int]:
    host, _, port = target.rpartition(":")
    return host.strip("[]"), int(port)


async def _handle(node, request: BytesValue, context) -> BytesValue:
    """Runs in the DHT process of the node asked."""
    peers = await node.p2p.list_peers()
    observed = _observed_hosts(next((p.addrs for p in peers if p.peer_id == context.remote_id), []))
    targets = list(json.loads(request.value or b"{}").get("targets", []))[:MAX_TARGETS]
    results: dict[str, str | None] = {}
    for target in targets:
        try:
            host, port = _split(str(target))
            ipaddress.ip_address(host)
        except ValueError:
            results[str(target)] = "not an IP:port address"
            continue
        if host not in observed:
            results[target] = f"not dialed: this peer connects from {', '.join(observed) or 'an unknown address'}"
        else:
            results[target] = await _dial(host, port)
    return BytesValue(value=json.dumps({"observed": observed, "results": results}).encode())


async def register(_dht, node) -> None:
    """Serve dial-back requests on this DHT node (run inside its DHT process)."""
    await node.p2p.add_protobuf_handler(HANDLER, functools.partial(_handle, node), BytesValue)


async def _ask(peer_id: str, targets: list[str], timeout_s: float, _dht, node) -> dict:
    from hivemind.p2p import PeerID

    request = BytesValue(value=json.dumps({"targets": targets}).encode())
    response = await asyncio.wait_for(
        node.p2p.call_protobuf_handler(PeerID.from_base58(peer_id), HANDLER, request, BytesValue), timeout_s
    )
    return json.loads(response.value)


def ask_dialback(dht, peer_id: str, targets: list[str], timeout_s: float = 10.0) -> dict:
    """Ask DHT node `peer_id` to dial `targets` back ("host:port"): {"observed": [...], "results": {target:
    None or why not}}. Raises on no answer (an older node, or none reachable)."""
    future = dht.run_coroutine(functools.partial(_ask, peer_id, targets, timeout_s), return_future=True)
    return future.result(timeout=timeout_s + 2)


def problems(answer: dict) -> list[str]:
    """One line per announced address that others cannot reach, with what to do."""
    out = []
    for target, why in answer.get("results", {}).items():
        if why is not None:
            out.append(f"{target} cannot be reached from outside: {why}")
    return out
