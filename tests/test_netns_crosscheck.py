"""TrafficMeter vs the kernel's byte counter: each rank in its own network namespace (needs root + iproute2)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

def _can_make_netns() -> bool:
    if os.geteuid() != 0 or shutil.which("ip") is None:
        return False
    probe = subprocess.run(["ip", "netns", "add", "herald_probe"], capture_output=True)
    subprocess.run(["ip", "netns", "del", "herald_probe"], capture_output=True)
    return probe.returncode == 0


pytestmark = pytest.mark.skipif(not _can_make_netns(), reason="needs root, iproute2 and network namespaces")


def test_kernel_tx_bytes_match_traffic_meter(tmp_path: Path) -> None:
    """Every byte the meter counts crosses the rank's veth link; the kernel adds only protocol
    overhead (TCP/IP headers, ACKs, gloo framing): 1.0 <= kernel / meter < 1.10."""
    import netns_crosscheck as nc

    world = 2
    nc.setup(world)
    try:
        rows = nc.run(world, 20, ["table_wise", "herald"], tmp_path)
    finally:
        nc.teardown(world)
    for row in rows:
        assert row["steps"] == 20
        for r in row["per_rank"]:
            assert r["meter_bytes"] > 0
            assert 1.0 <= r["kernel_tx_bytes"] / r["meter_bytes"] < 1.10, (row["planner"], r)
