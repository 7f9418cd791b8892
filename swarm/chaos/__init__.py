"""`swarm chaos`: a local swarm trained through injected faults, then checked sample by sample.

`config` holds the options, `faults` the fault kinds (what each does to which process), `runner` the
run: a fault-free phase (the throughput baseline, same swarm and settings), the chaos phase (faults
on a schedule or at random with a mean time between faults), the ledger check, and the check that no
process was left behind."""
