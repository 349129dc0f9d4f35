"""CPU per training step, per rank: the training thread's own, and the whole process's (the training thread,
herald's scheduler thread, gloo's threads), against the step's wall time, herald vs stock at W=2 on loopback.

On this 2-core host two ranks share two cores: where the ranks' process CPU per step adds up to about
2 × the wall time, the step is CPU-bound, and time a configuration saves on the link returns only as far
as its CPU allows (issue 28: the scheduler thread's CPU comes out of the same cores as training's).

    python benchmarks/cpu_per_step.py [--steps 200] [--warmup 30] [--configs hot herald het] [--json out.json]

Each configuration trains 2 ranks (gloo, no link limit, the default data); rank r times ``steps`` steps
after ``warmup``: wall time, ``time.thread_time`` of the training thread, ``time.process_time`` of the
process (every thread).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from step_ops import CONFIGS as STEP_OPS_CONFIGS, build_cpu_run  # noqa: E402 (the ops count's configurations)

CONFIGS: Dict[str, tuple] = dict(STEP_OPS_CONFIGS, het=(
    "herald + scheduling + HET staleness 3", STEP_OPS_CONFIGS["herald"][1] + ["pipeline.staleness=3",
                                                                            "pipeline.reference=false"]))


def worker(rank: int, world: int, config: str, steps: int, warmup: int) -> Dict[str, Any]:
    _, pipeline, it, _ = build_cpu_run(CONFIGS[config][1], warmup + steps + 10, rank, world)
    for _ in range(warmup):
        pipeline.progress(it)
    w0, t0, p0 = time.perf_counter(), time.thread_time(), time.process_time()
    for _ in range(steps):
        out = pipeline.progress(it)
    out[0].item()
    wall, thread, process = time.perf_counter() - w0, time.thread_time() - t0, time.process_time() - p0
    pipeline.detach()
    ms = 1000.0 / steps
    return {"rank": rank, "wall_ms": wall * ms, "training_thread_cpu_ms": thread * ms, "process_cpu_ms": process * ms}


def main(argv: Optional[List[str]] = None) -> None:
    from torchrec_herald.dist_utils import run_multiprocess

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--configs", nargs="+", default=["hot", "herald", "het"], choices=list(CONFIGS))
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    rows = []
    for config in a.configs:
        ranks = run_multiprocess(worker, 2, config, a.steps, a.warmup, timeout_s=1800)
        wall = max(r["wall_ms"] for r in ranks)
        rows.append({"config": config, "label": CONFIGS[config][0], "ranks": ranks, "wall_ms": wall,
                     "all_ranks_process_cpu_ms": sum(r["process_cpu_ms"] for r in ranks),
                     "cores_busy": sum(r["process_cpu_ms"] for r in ranks) / wall})
    command = "python benchmarks/cpu_per_step.py " + " ".join(argv if argv is not None else sys.argv[1:])
    print(f"Command: `{command.strip()}` (2 ranks, loopback; ms per step)\n")
    print("| configuration | wall | training thread CPU (rank 0 / 1) | process CPU (rank 0 / 1) | "
          "other threads' CPU (rank 0 / 1) | cores busy (of 2) |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        t = " / ".join(f"{x['training_thread_cpu_ms']:.1f}" for x in r["ranks"])
        pc = " / ".join(f"{x['process_cpu_ms']:.1f}" for x in r["ranks"])
        o = " / ".join(f"{x['process_cpu_ms'] - x['training_thread_cpu_ms']:.1f}" for x in r["ranks"])
        print(f"| {r['label']} | {r['wall_ms']:.1f} | {t} | {pc} | {o} | {r['cores_busy']:.2f} |")
    if a.json:
        Path(a.json).write_text(json.dumps({"command": command.strip(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
