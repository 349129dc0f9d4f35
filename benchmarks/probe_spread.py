"""How much the start-up link probe's reading moves from job to job on one shaped link, by the number of transfers
it averages at its last size (``probe_link(repeats=...)``): the model of time prices every plan at that reading.

Each rank runs in its own network namespace (``bench_bandwidth.py``'s plumbing, links shaped with ``tc``); every
probe runs on a fresh process group (fresh TCP connections, as a new job's), the settings interleaved so that a
drift of the host's speed reaches them alike.

    sudo .venv/bin/python benchmarks/probe_spread.py --rates 200 50 --repeats 2 4 --probes 10
        [--world-size 2] [--out benchmarks/results/probe_spread.json]

Writes the JSON (every probe's all-to-all and all-reduce rate and seconds) and prints a table: per rate and
``repeats``, the median, range and spread (max / min) of the all-to-all reading and the probe's mean seconds.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Dict, List

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))


def worker(repeats: List[int], probes: int, out: str) -> None:
    """One rank (inside its namespace): ``probes`` rounds, each one probe per ``repeats`` setting."""
    import torch
    import torch.distributed as dist

    from torchrec_herald.dist_utils import init_distributed
    from torchrec_herald.planner.link_probe import probe_group, probe_link

    torch.set_num_threads(1)
    init_distributed()
    rows: List[Dict[str, Any]] = []
    for i in range(probes):
        for r in repeats:
            group = probe_group(None, 60.0)  # (a fresh group: new connections, as a new job's probe)
            p = probe_link(group, repeats=r)
            rows.append({"round": i, "repeats": r, "link_mbit": p.link_mbit, "allreduce_mbit": p.allreduce_mbit,
                         "latency_ms": p.latency_ms, "seconds": p.seconds, "total_bytes_per_rank": p.total_bytes_per_rank})
            dist.destroy_process_group(group)
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(rows))
    dist.destroy_process_group()


def summary(rows: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    out = []
    for (rate, r) in sorted({(x["rate_mbit"], x["repeats"]) for x in rows}, key=lambda k: (-k[0], k[1])):
        these = [x for x in rows if (x["rate_mbit"], x["repeats"]) == (rate, r)]
        a2a, ar = [x["link_mbit"] for x in these], [x["allreduce_mbit"] for x in these]
        secs = [x["seconds"] for x in these]
        out.append({"rate_mbit": rate, "repeats": r, "probes": len(a2a), "a2a_median": statistics.median(a2a),
                    "a2a_min": min(a2a), "a2a_max": max(a2a), "a2a_spread": max(a2a) / min(a2a),
                    "a2a_stdev_share": statistics.pstdev(a2a) / statistics.mean(a2a),
                    "allreduce_median": statistics.median(ar), "allreduce_spread": max(ar) / min(ar),
                    "seconds_mean": statistics.mean(secs)})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rates", type=int, nargs="+", default=[200, 50])
    ap.add_argument("--repeats", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--probes", type=int, default=10)
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--out", default=str(HERE / "results" / "probe_spread.json"))
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--worker-out")
    a = ap.parse_args()
    if a.worker:
        worker(a.repeats, a.probes, a.worker_out)
        return
    from bench_bandwidth import limit
    from netns_crosscheck import run_in_namespaces, setup, teardown

    W, rows = a.world_size, []
    tmp = Path(a.out).with_suffix(".part")
    setup(W)
    try:
        for i, rate in enumerate(a.rates):
            limit(W, rate)
            t0 = time.time()
            run_in_namespaces(W, 29400 + (os.getpid() % 200) + i, lambda r: [
                __file__, "--worker", "--repeats", *map(str, a.repeats), "--probes", str(a.probes),
                "--worker-out", str(tmp)], f"rate {rate}")
            rows += [dict(x, rate_mbit=rate, world_size=W) for x in json.loads(tmp.read_text())]
            print(f"rate {rate}: {time.time() - t0:.0f} s", flush=True)
    finally:
        teardown(W)
        tmp.unlink(missing_ok=True)
    result = {"command": " ".join(["python", "benchmarks/probe_spread.py", *sys.argv[1:]]), "probes": rows,
              "summary": summary(rows)}
    Path(a.out).write_text(json.dumps(result, indent=1))
    print("| ranks | link | repeats | probes | all-to-all Mbit/s median (min–max) | spread | all-reduce median (spread) "
          "| probe s |")
    print("|---|---|---|---|---|---|---|---|")
    for s in result["summary"]:
        print(f"| {W} | {s['rate_mbit']} Mbit/s | {s['repeats']} | {s['probes']} | {s['a2a_median']:.1f} "
              f"({s['a2a_min']:.1f}–{s['a2a_max']:.1f}) | {s['a2a_spread']:.2f} | {s['allreduce_median']:.1f} "
              f"({s['allreduce_spread']:.2f}) | {s['seconds_mean']:.2f} |")


if __name__ == "__main__":
    main()
