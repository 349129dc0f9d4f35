"""Where the training thread's CPU goes in the plan executor: each PlanExecutor and RowStore method, CPU ms
per step on rank 0 (its own thread's time, ``time.thread_time``, so waiting on a collective is not counted).

Trains 2 ranks on CPU (gloo, no link limit) with ``planner=herald pipeline=herald pipeline.scheduling=on
planner.link_mbit=200`` plus the overrides. Methods nest (``finish`` calls ``after_backward``, which calls
``move_rows``...), so the rows do not add up. A/B a change by running it on both sides.

    python benchmarks/executor_cpu.py [--steps 300] [--json out.json] [overrides ...]
    python benchmarks/executor_cpu.py pipeline.staleness=3 pipeline.reference=false   # HET
"""

from __future__ import annotations

import sys
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Dict, List

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

BASE_OVERRIDES = ["planner=herald", "pipeline=herald", "pipeline.scheduling=on", "planner.link_mbit=200"]
EXECUTOR = ["begin", "working_set", "finish", "after_backward", "prefetch", "move_rows", "_store_received",
            "_row_payload", "_start_reduce", "_route"]
STORE = ["read", "write", "receive", "payload", "rebase", "base", "drop", "_give_slots"]


def _rank(rank: int, world: int, overrides: List[str], steps: int, out: str) -> Dict[str, Any]:
    import torchrec_herald.sharding.plan_exec as plan_exec
    import torchrec_herald.sharding.row_store as row_store
    from torchrec_herald.config import compose_config
    from torchrec_herald.trainer import Trainer

    cpu: Dict[str, float] = defaultdict(float)
    calls: Dict[str, int] = defaultdict(int)
    training = threading.get_ident()

    def timed(cls: type, name: str) -> None:
        fn = getattr(cls, name)

        def run(*a: Any, **k: Any) -> Any:
            if threading.get_ident() != training:  # (the scheduler thread's plans are not the executor's)
                return fn(*a, **k)
            c0 = time.thread_time()
            try:
                return fn(*a, **k)
            finally:
                cpu[f"{cls.__name__}.{name}"] += time.thread_time() - c0
                calls[f"{cls.__name__}.{name}"] += 1

        setattr(cls, name, run)

    for name in EXECUTOR:
        timed(plan_exec.PlanExecutor, name)
    for name in STORE:
        timed(row_store.RowStore, name)
    cfg = compose_config(overrides + [f"data.num_train_batches={steps}", "eval=false"])
    c0, w0 = time.thread_time(), time.perf_counter()
    Trainer(cfg, Path(out).with_suffix(f".run{rank}"), show_progress=False).build().train()
    return {"rank": rank, "steps": steps, "training_thread_cpu_ms": 1e3 * (time.thread_time() - c0) / steps,
            "run_seconds": time.perf_counter() - w0,
            "per_step": {k: {"cpu_ms": 1e3 * v / steps, "calls": calls[k] / steps} for k, v in sorted(cpu.items())}}


def main() -> None:
    from scheduler_stages import report, run_two_ranks

    res, out = run_two_ranks(_rank, __doc__, "executor_cpu", BASE_OVERRIDES)
    report(res, out, "method", {"cpu_ms": "CPU ms/step", "calls": "calls/step"},
           f"training thread CPU per step: {res['training_thread_cpu_ms']:.2f} ms; run {res['run_seconds']:.1f} s")


if __name__ == "__main__":
    main()
