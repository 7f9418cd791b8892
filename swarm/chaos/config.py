"""`swarm chaos`'s settings (its command line is generated from them)."""

from __future__ import annotations

from dataclasses import dataclass

from swarm.core.settings import setting

FAULT_KINDS = ("kill", "stop", "term", "join", "trainer", "coordinator", "cut")
NETNS_KINDS = ("cut",)  # kinds that need the swarm in a network lab (--netns, as root)


def kinds_list(text: str) -> list[str]:
    kinds = [k.strip() for k in text.split(",") if k.strip()]
    unknown = sorted(set(kinds) - set(FAULT_KINDS))
    if unknown:
        raise ValueError(f"unknown fault kinds {unknown}; choose from {', '.join(FAULT_KINDS)}")
    return kinds


@dataclass
class ChaosOptions:
    minutes: float = setting(10.0, "length of the chaos phase, in minutes")
    mtbf_s: float = setting(15.0, "mean time between faults (exponential), in seconds", flag="--mtbf")
    baseline_minutes: float = setting(
        2.0, "length of the fault-free phase before it (the throughput baseline), in minutes"
    )
    kinds: list[str] | None = setting(
        None,
        "fault kinds to draw from, comma-separated: " + ", ".join(FAULT_KINDS) + " (default: all of them; "
        "'cut', a peer's network link cut for a while, only with --netns)",
        parse=kinds_list,
        metavar="KIND,...",
    )
    schedule: list[str] | None = setting(
        None,
        "instead of random faults, these kinds in this order, evenly spread over the chaos phase",
        parse=kinds_list,
        metavar="KIND,...",
    )
    chaos_seed: int = setting(0, "seed of the fault schedule and of the choice of victims")
    stop_pause_s: float = setting(8.0, "a SIGSTOPped peer is resumed (SIGCONT) after up to this many seconds")
    replace_after_s: float = setting(
        5.0,
        "a killed or terminated peer is replaced by a new one after this long (if the swarm is below its "
        "starting size)",
    )
    restart_after_s: float = setting(2.0, "a killed trainer or coordinator is started again after this long")
    cut_pause_s: float = setting(12.0, "a cut link is mended after up to this many seconds")
    max_extra_peers: int = setting(2, "joins beyond the initial number of peers, at most")

    def __post_init__(self) -> None:
        if self.minutes <= 0 or self.mtbf_s <= 0 or self.baseline_minutes < 0:
            raise ValueError("--minutes and --mtbf must be positive, --baseline-minutes not negative")
        if self.kinds is not None and not self.kinds:
            raise ValueError("--kinds must name at least one fault kind")

    def resolve_kinds(self, netns: bool) -> None:
        """Fill in the default kinds (those this swarm can take) and refuse a network fault without a lab."""
        if self.kinds is None:
            self.kinds = [k for k in FAULT_KINDS if netns or k not in NETNS_KINDS]
        needs_lab = sorted(set(self.kinds + (self.schedule or [])) & set(NETNS_KINDS))
        if needs_lab and not netns:
            raise ValueError(
                f"fault kind {', '.join(needs_lab)} cuts a peer's network link: it needs the swarm in a network lab "
                "(--netns lan, as root)"
            )
