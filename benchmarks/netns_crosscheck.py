"""Cross-check TrafficMeter against the kernel: every rank in its own network namespace (docs/design.md §6).

    sudo .venv/bin/python benchmarks/netns_crosscheck.py [--world-sizes 2 4] [--steps 100] [--planners table_wise herald]

Each rank runs in network namespace ``herald_nsR`` whose only link ``ethR`` (a veth pair, the other end
on a bridge) carries all of its gloo traffic (``GLOO_SOCKET_IFNAME``). Around the same training loop a
rank reads its link's kernel counter ``tx_bytes`` and TrafficMeter's bytes sent to other ranks. The
kernel also counts TCP/IP/Ethernet headers, ACKs of received data and gloo's own framing, so it must
be at least the meter's figure, and their ratio is the protocol overhead. Needs root and iproute2;
writes ``benchmarks/results/netns.json`` and the NETNS section of ``benchmarks/RESULTS.md``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, List

HERE = Path(__file__).resolve().parent
BRIDGE, SUBNET, PORT = "herald_br0", "10.213.0", 29561
logger = logging.getLogger("netns_crosscheck")


def sh(*cmd: str) -> None:
    subprocess.run(list(cmd), check=True, capture_output=True)


def setup(world: int) -> None:
    """A bridge in the root namespace and one namespace per rank with a veth link to it."""
    teardown(world)
    sh("ip", "link", "add", BRIDGE, "type", "bridge")
    sh("ip", "link", "set", BRIDGE, "up")
    for r in range(world):
        ns, host, peer = f"herald_ns{r}", f"herald_v{r}", f"eth{r}"
        sh("ip", "netns", "add", ns)
        sh("ip", "link", "add", host, "type", "veth", "peer", "name", peer, "netns", ns)
        sh("ip", "link", "set", host, "master", BRIDGE)
        sh("ip", "link", "set", host, "up")
        sh("ip", "netns", "exec", ns, "ip", "addr", "add", f"{SUBNET}.{r + 1}/24", "dev", peer)
        sh("ip", "netns", "exec", ns, "ip", "link", "set", peer, "up")
        sh("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")


def teardown(world: int) -> None:
    for r in range(world):
        subprocess.run(["ip", "netns", "del", f"herald_ns{r}"], capture_output=True)
        subprocess.run(["ip", "link", "del", f"herald_v{r}"], capture_output=True)
    subprocess.run(["ip", "link", "del", BRIDGE], capture_output=True)


def tx_bytes(ifname: str) -> int:
    return int(Path(f"/sys/class/net/{ifname}/statistics/tx_bytes").read_text())


def worker(planner: str, steps: int, out: str) -> None:
    """One rank (inside its namespace): train ``steps`` steps, meter and kernel counter around them."""
    import torch
    import torch.distributed as dist

    from torchrec_herald.config import compose_config
    from torchrec_herald.data import build_data_source
    from torchrec_herald.dist_utils import init_distributed
    from torchrec_herald.trainer import PIPELINES, build_model_and_plan
    from torchrec_herald.traffic import TrafficMeter

    torch.set_num_threads(1)
    rank, world, device = init_distributed()
    cfg = compose_config([f"planner={planner}", f"data.num_train_batches={steps}"])
    data = build_data_source(cfg.data)
    dmp, optimizer, _ = build_model_and_plan(cfg, data, world, device)
    pipeline = PIPELINES[cfg.pipeline.name](dmp, optimizer, device)
    it = data.train_batches(rank, world, cfg.batch_size)
    ifname = f"eth{rank}"
    dist.barrier()
    time.sleep(0.5)  # let the barrier's packets and their ACKs drain before the window opens
    k0 = tx_bytes(ifname)
    with TrafficMeter(embedding_dim=cfg.model.embedding_dim) as meter:
        n = 0
        while True:
            try:
                pipeline.progress(it)
                n += 1
            except StopIteration:
                break
    time.sleep(0.5)  # ACKs of the last received data
    k1 = tx_bytes(ifname)
    result = {"rank": rank, "planner": planner, "steps": n, "meter_bytes": meter.total()["bytes"],
              "kernel_tx_bytes": k1 - k0, "meter": meter.summary()}
    Path(out).write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


def run_in_namespaces(world: int, port: int, args_of_rank: Callable[[int], List[str]], what: str,
                      timeout: float = 900) -> None:
    """Run ``python <args_of_rank(r)>`` as rank r inside ``herald_nsR`` (gloo on its link ``ethR``, the
    rendezvous at rank 0's address) for every rank; wait for all; a failed rank's stderr in the error."""
    procs = []
    for r in range(world):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(world), LOCAL_RANK=str(r), MASTER_ADDR=f"{SUBNET}.1",
                   MASTER_PORT=str(port), GLOO_SOCKET_IFNAME=f"eth{r}", OMP_NUM_THREADS="1")
        cmd = ["ip", "netns", "exec", f"herald_ns{r}", sys.executable, *args_of_rank(r)]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
    for p in procs:
        _, err = p.communicate(timeout=timeout)
        if p.returncode != 0:
            raise RuntimeError(f"rank failed ({what}): {err.decode()[-3000:]}")


def run(world: int, steps: int, planners: List[str], tmp: Path) -> List[Dict[str, Any]]:
    rows = []
    for planner in planners:
        run_in_namespaces(world, PORT, lambda r: [__file__, "--worker", "--planner", planner, "--steps", str(steps),
                                                  "--out", str(tmp / f"{planner}_{r}.json")], planner)
        per_rank = [json.loads((tmp / f"{planner}_{r}.json").read_text()) for r in range(world)]
        meter = sum(x["meter_bytes"] for x in per_rank)
        kernel = sum(x["kernel_tx_bytes"] for x in per_rank)
        rows.append({"planner": planner, "world_size": world, "steps": per_rank[0]["steps"],
                     "meter_bytes_per_step": meter / per_rank[0]["steps"],
                     "kernel_tx_bytes_per_step": kernel / per_rank[0]["steps"],
                     "kernel_over_meter": kernel / meter if meter else float("nan"), "per_rank": per_rank})
        logger.info("%s: meter %.0f B/step, kernel %.0f B/step", planner, rows[-1]["meter_bytes_per_step"],
                    rows[-1]["kernel_tx_bytes_per_step"])
    return rows


def markdown(rows: List[Dict[str, Any]], command: str) -> str:
    lines = [f"Command: `{command}`", "",
             "| planner | ranks | steps | TrafficMeter KiB/step | kernel tx KiB/step (veth) | kernel / meter |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['planner']} | {r['world_size']} | {r['steps']} | {r['meter_bytes_per_step'] / 1024:.1f} | "
                     f"{r['kernel_tx_bytes_per_step'] / 1024:.1f} | {r['kernel_over_meter']:.3f} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--planners", nargs="+", default=["table_wise", "herald"])
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--planner", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        worker(a.planner, a.steps, a.out)
        return
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    if os.geteuid() != 0:
        raise SystemExit("netns_crosscheck needs root (ip netns / veth)")
    import tempfile

    rows: List[Dict[str, Any]] = []
    for world in a.world_sizes:
        setup(world)
        try:
            with tempfile.TemporaryDirectory() as tmp:
                rows += run(world, a.steps, a.planners, Path(tmp))
        finally:
            teardown(world)
    out = HERE / "results"
    out.mkdir(exist_ok=True)
    (out / "netns.json").write_text(json.dumps(rows, indent=2))
    command = "python benchmarks/netns_crosscheck.py " + " ".join(sys.argv[1:])
    section = markdown(rows, command.strip())
    sys.path.insert(0, str(HERE))
    from bench_traffic import write_results_md

    write_results_md({"NETNS": section})
    sys.stdout.write(section + "\n")


if __name__ == "__main__":
    main()
