"""The dashboard's Prometheus view: a private CollectorRegistry built from one state document.

Families: swarm_peers{stage,state}, swarm_stage_live_peers{stage},
swarm_stage_throughput_samples_per_second{stage}, swarm_global_step, swarm_train_loss, swarm_val_loss,
swarm_samples_per_second, swarm_bottleneck_stage, swarm_healthy, swarm_dht_ok, swarm_source_ok and
swarm_events_total{kind} (the source's `events_total`: events seen since the dashboard started).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from swarm.dashboard.source import PEER_STATES, current_losses

logger = logging.getLogger(__name__)


def _number(value: object) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


class StateCollector(Collector):
    """Yields the metric families of one state document."""

    def __init__(self, doc: dict, source_ok: bool = True) -> None:
        self.doc = doc
        self.source_ok = source_ok

    def collect(self) -> Iterator[Metric]:
        yield from self._stage_families()
        yield from self._run_families()
        events = CounterMetricFamily("swarm_events", "Swarm events seen since the dashboard started", labels=["kind"])
        for kind, count in sorted((self.doc.get("events_total") or {}).items()):
            if _number(count) is not None:
                events.add_metric([str(kind)], float(count))
        yield events

    def _stage_families(self) -> Iterator[Metric]:
        peers = GaugeMetricFamily("swarm_peers", "Peers per stage and state", labels=["stage", "state"])
        live = GaugeMetricFamily(
            "swarm_stage_live_peers", "Live (online or draining) peers per stage", labels=["stage"]
        )
        throughput = GaugeMetricFamily(
            "swarm_stage_throughput_samples_per_second", "Throughput of a stage's live peers", labels=["stage"]
        )
        for stage in self.doc.get("stages") or []:
            k = str(stage.get("stage"))
            counts = dict.fromkeys(PEER_STATES, 0)
            for peer in stage.get("peers") or []:
                state = str(peer.get("state"))
                counts[state] = counts.get(state, 0) + 1
            for state, count in counts.items():
                peers.add_metric([k, state], count)
            live.add_metric([k], _number(stage.get("live_peers")) or 0.0)
            throughput.add_metric([k], _number(stage.get("throughput")) or 0.0)
        yield from (peers, live, throughput)

    def _run_families(self) -> Iterator[Metric]:
        doc = self.doc
        train_loss, val_loss = current_losses(doc)
        values = {
            "swarm_global_step": ("Global optimizer step", doc.get("step")),
            "swarm_samples_per_second": ("Samples per second through the whole pipeline", doc.get("samples_per_s")),
            "swarm_train_loss": ("Training loss (mean over trainers)", train_loss),
            "swarm_val_loss": ("Validation loss (mean over trainers)", val_loss),
            "swarm_bottleneck_stage": ("Index of the slowest stage", doc.get("bottleneck")),
            "swarm_healthy": ("1 when every stage has a live peer", doc.get("healthy")),
            "swarm_dht_ok": ("1 when the collector reaches the DHT", doc.get("dht_ok")),
            "swarm_source_ok": ("1 when the dashboard's last snapshot succeeded", self.source_ok),
        }
        for name, (doc_text, value) in values.items():
            number = float(value) if isinstance(value, bool) else _number(value)
            if number is not None:  # an unknown value is left out, not reported as 0
                yield GaugeMetricFamily(name, doc_text, value=number)


def render_metrics(doc: dict, source_ok: bool = True) -> bytes:
    """The Prometheus text exposition of `doc`."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StateCollector(doc, source_ok))
    return generate_latest(registry)
