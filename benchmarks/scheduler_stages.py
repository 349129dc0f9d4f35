"""Where the scheduler thread's time goes: each batch stage (keys, allocate, skip_inputs, reads), reading
the batch, and the plan, per step on rank 0, as thread CPU time and wall time.

Trains 2 ranks on CPU (gloo, no link limit) with ``planner=herald pipeline=herald pipeline.scheduling=on
planner.link_mbit=200`` plus the overrides, wrapping each stage, ``schedule_next`` and ``make_plan`` with
timers. CPU time is the thread's own (``time.thread_time``); wall time includes waiting for the GIL and
the cores (2 ranks share this host's 2 cores). A/B a change by running it on both sides.

    python benchmarks/scheduler_stages.py [--steps 300] [--json out.json] [overrides ...]
    python benchmarks/scheduler_stages.py pipeline.staleness=3 pipeline.reference=false   # HET
    python benchmarks/scheduler_stages.py pipeline.scheduler_impl=python                  # the references
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

BASE_OVERRIDES = ["planner=herald", "pipeline=herald", "pipeline.scheduling=on", "planner.link_mbit=200"]


def _rank(rank: int, world: int, overrides: List[str], steps: int, out: str) -> Dict[str, Any]:
    import torchrec_herald.pipeline.train_pipeline as tp
    from torchrec_herald.config import compose_config
    from torchrec_herald.trainer import Trainer

    cpu: Dict[str, float] = defaultdict(float)
    wall: Dict[str, float] = defaultdict(float)
    plans = [0]

    def timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def run(*a: Any, **k: Any) -> Any:
            c0, w0 = time.thread_time(), time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                cpu[name] += time.thread_time() - c0
                wall[name] += time.perf_counter() - w0
        return run

    stages = tp.batch_stages
    tp.batch_stages = lambda: [(n, timed(n, f)) for n, f in stages()]  # type: ignore[assignment]
    make_plan = tp.make_plan

    def counted_plan(*a: Any, **k: Any) -> Any:
        plans[0] += 1
        return timed("plan", make_plan)(*a, **k)

    tp.make_plan = counted_plan  # type: ignore[assignment]
    tp.HeraldTrainPipeline.schedule_next = timed("batch_in", tp.HeraldTrainPipeline.schedule_next)  # type: ignore[method-assign]
    cfg = compose_config(overrides + [f"data.num_train_batches={steps}", "eval=false"])
    t0 = time.perf_counter()
    Trainer(cfg, Path(out).with_suffix(f".run{rank}"), show_progress=False).build().train()
    seconds = time.perf_counter() - t0
    n = max(plans[0], 1)
    per = {name: {"cpu_ms": 1e3 * cpu[name] / n, "wall_ms": 1e3 * wall[name] / n} for name in cpu}
    stage_cpu = sum(v["cpu_ms"] for k, v in per.items() if k not in ("batch_in", "plan"))
    per["read_batch"] = {"cpu_ms": per["batch_in"]["cpu_ms"] - stage_cpu, "wall_ms": float("nan")}
    return {"rank": rank, "plans": plans[0], "run_seconds": seconds, "per_step": per,
            "thread_cpu_ms": per["batch_in"]["cpu_ms"] + per["plan"]["cpu_ms"]}


def run_two_ranks(rank: Callable[..., Dict[str, Any]], description: str, script: str,
                  base_overrides: List[str]) -> Tuple[Dict[str, Any], Optional[str]]:
    """The command line (``--steps``, ``--json``, overrides) of a two-rank timing script: trains 2 ranks
    with ``rank(rank, world, overrides, steps, out)``; returns rank 0's result (its overrides and command
    added) and the ``--json`` path."""
    ap = argparse.ArgumentParser(description=description.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--json")
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args()
    from torchrec_herald.dist_utils import run_multiprocess

    overrides = base_overrides + a.overrides
    res = run_multiprocess(rank, 2, overrides, a.steps, f"/tmp/{script}", timeout_s=3600)[0]
    res["overrides"] = overrides
    res["command"] = f"python benchmarks/{script}.py " + " ".join(sys.argv[1:])
    return res, a.json


def report(res: Dict[str, Any], out: Optional[str], name: str, columns: Dict[str, str], total: str) -> None:
    """Print ``res["per_step"]`` as a table (``name`` column, then ``columns``: key -> heading, 2 decimals)
    and the ``total`` line; write ``res`` as JSON to ``out`` where given."""
    width = max([len(name)] + [len(k) for k in res["per_step"]])
    print(f"{name:<{width}} " + " ".join(f"{h:>13}" for h in columns.values()))
    for key, v in sorted(res["per_step"].items()):
        print(f"{key:<{width}} " + " ".join(f"{v[c]:>13.2f}" for c in columns))
    print(total)
    if out:
        Path(out).write_text(json.dumps(res, indent=1))


def main() -> None:
    res, out = run_two_ranks(_rank, __doc__, "scheduler_stages", BASE_OVERRIDES)
    report(res, out, "stage", {"cpu_ms": "CPU ms/step", "wall_ms": "wall ms/step"},
           f"scheduler thread CPU per step (batch in + plan): {res['thread_cpu_ms']:.2f} ms; run {res['run_seconds']:.1f} s")


if __name__ == "__main__":
    main()
