"""`swarm sim`: a discrete-event simulator that runs the real wiring (swarm.policy.wiring) and rebalancing
(swarm.policy.rebalance) code against 10..10,000 simulated peers, to measure them without machines.

    from swarm.sim import SimConfig, run_sim
    result = run_sim(SimConfig(peers=1000, stages=8, policy="ours", rebalance=True))
    result.throughput_fraction_of_ideal
"""

from swarm.sim.config import RunResult, SimConfig
from swarm.sim.engine import Simulator, run_sim

__all__ = ["RunResult", "SimConfig", "Simulator", "run_sim"]
