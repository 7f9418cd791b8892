"""`swarm local --netns`: a swarm whose every process (coordinator, peers, trainer) runs on its own host of a
network lab (own namespace and address, shaped link), trains over the "internet" profile, routes around a slow
link, and leaves no namespace behind. Root only, as the test command has (CI runs as root)."""

from __future__ import annotations

import json
import subprocess

import pytest

from swarm.netlab import check_available, naming
from tests.integration.helpers import run_args, start_training

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture(autouse=True, scope="module")
def _labs_available():
    check_available()


def netns_names() -> str:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=10).stdout


def test_three_stages_by_two_peers_train_over_the_internet_profile(make_swarm):
    swarm = make_swarm(netns="internet", stages=3, peers_per_stage=2, trainers=1, run_args=run_args())
    swarm.start()
    start_training(swarm, 12)
    (summary,) = swarm.wait_trainers(timeout=400)
    hosts = swarm.lab.hosts()
    prefix = naming.lab_prefix(swarm.lab.lab.key)
    swarm.stop()
    assert prefix not in netns_names()  # the lab went with the swarm
    print(json.dumps({k: summary[k] for k in ("loss_first", "loss_last", "val_loss", "samples_per_s")}))
    assert summary["loss_last"] < summary["loss_first"] - 0.3, summary
    assert len(hosts) == 8 and len({h.ip for h in hosts.values()}) == 8  # one host per process
    assert {h.link.rate_mbit for h in hosts.values()} == {100}
    for proc in swarm.peers:
        host = hosts[proc.name]
        assert proc.ready["address"].startswith(host.ip + ":")  # bound to, and announcing, its lab address
        assert all(m.startswith(f"/ip4/{host.ip}/") for m in proc.ready["dht_maddrs"])
    assert swarm.initial_peers[0].startswith(f"/ip4/{hosts['coordinator'].ip}/")


@pytest.mark.alone  # the share of work follows the link's cost against compute on free cores
def test_a_ten_times_slower_link_gets_at_most_a_third_of_its_stage(make_swarm, tmp_path):
    """Stage 1's second peer has a 10 Mbit/s link, its mate 100 Mbit/s (the same delays): a microbatch's
    activations (512 KiB, uncompressed) and their gradient take 10x longer to cross it, and the trainer's
    wiring sends it less."""
    profile = tmp_path / "one-slow.yaml"
    profile.write_text("extends: internet\nhosts:\n  peer3-s1: {rate_mbit: 10}\n")
    model = {"kind": "gpt", "vocab_size": 256, "seq_len": 128, "d_model": 128, "n_layers": 2, "n_heads": 4,
             "d_ff": 256}  # fmt: skip
    swarm = make_swarm(
        netns=str(profile), stages=2, peers_per_stage=2, trainers=1,
        run_args=run_args(model, global_batch=32, microbatch=8, codec="none"), peer_args=["--no-rebalance"],
    )  # fmt: skip
    swarm.start()
    start_training(swarm, 10)
    swarm.wait_trainers(timeout=400)
    assert swarm.lab.hosts()["peer3-s1"].link.rate_mbit == 10
    swarm.stop()
    samples = {p.name: p.counters["samples_processed"] for p in swarm.peers}
    print(json.dumps(samples))
    stage1 = samples["peer2-s1"] + samples["peer3-s1"]
    assert stage1 > 0
    assert samples["peer3-s1"] <= stage1 / 3, samples


def test_lab_of_a_killed_local_swarm_is_removed_at_the_next_start(tmp_path):
    """`swarm local --netns` SIGKILLed: its lab stays (nobody could clean up) until the next start, which
    removes labs whose owner is gone."""
    import os
    import signal
    import sys

    from swarm.netlab.hosts import LabHosts

    argv = [sys.executable, "-m", "swarm.cli", "local", "--netns", "lan", "--run-id", f"killed-{os.getpid()}",
            "--log-dir", str(tmp_path / "logs"), *run_args()]  # fmt: skip
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True)
    try:
        assert any(line.startswith("coordinator: /ip4/100.6") for line in proc.stdout)  # lab up, coordinator ready
        key = naming.lab_key(f"killed-{os.getpid()}")
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        assert naming.lab_prefix(key) in netns_names()  # left behind...
        LabHosts(f"next-{os.getpid()}", "lan").close()  # ...until the next start
        assert naming.lab_prefix(key) not in netns_names()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
