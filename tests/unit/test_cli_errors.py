"""The one place where a user's mistake becomes one stderr line and exit code 2 (swarm.cli.main), for the
`--netns` cases that a root test machine cannot reach by itself: not root, an unknown profile."""

from __future__ import annotations

import pytest

from swarm.cli import main
from swarm.netlab import system


def one_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


def test_netns_without_root(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(system.os, "geteuid", lambda: 1000)
    assert main(["local", "--netns", "internet", "--log-dir", str(tmp_path)]) == 2
    line = one_line(capsys)
    assert line.startswith("swarm local: error: --netns internet:")
    assert "needs root" in line and "without --netns" in line


def test_unknown_network_profile(capsys, tmp_path):
    if system.os.geteuid() != 0:
        pytest.skip("needs root to get past the root check")
    assert main(["local", "--netns", "satellite", "--log-dir", str(tmp_path)]) == 2
    assert "unknown network profile 'satellite'" in one_line(capsys)
