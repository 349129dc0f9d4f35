"""The same training run three times in the same ranks, one after another, as ``compare_with`` ran its baseline and
then the run in one job (``compare_turn_steps=0`` still does): does a run trained second go slower for being second?
(W=2, gloo, loopback.)

    python benchmarks/run_order.py OUT_DIR [Hydra overrides, e.g. eval=false]

Prints, per run: samples/s, the OS threads of rank 0 before and after it, Python threads, and its compute ms a step;
then, per run, rank 0's OS threads that used CPU during it (name, thread id, CPU seconds, from ``/proc/self/task``).
"""

from __future__ import annotations

import os
import sys
import threading
from typing import Any, Dict, List, Tuple

from torchrec_herald.dist_utils import run_multiprocess


def thread_cpu() -> Dict[Tuple[int, str], float]:
    """This process's OS threads: (thread id, name) -> CPU seconds so far (user + system, ``/proc/self/task``)."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                stat = f.read()
        except FileNotFoundError:  # (a thread that ended as it was read)
            continue
        name = stat[stat.index("(") + 1:stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2:].split()
        out[(int(tid), name)] = (int(fields[11]) + int(fields[12])) / tick
    return out


def worker(rank: int, world: int, out: str, overrides: List[str], runs: int = 3,
           eval_data_only: bool = False) -> List[Tuple[Any, ...]]:
    """``runs`` runs of stock TABLE_WISE in this rank, one after another; ``eval_data_only``: each run's eval
    pass reads its batches and runs no model on them (``benchmarks/run_order_eval.py``)."""
    import gc

    import torchrec_herald.trainer as trainer
    from torchrec_herald.config import compose_config

    if eval_data_only:
        trainer.evaluate = lambda dmp, batches, device: ([None for _ in batches], {"auc": 0.5, "logloss": 0.7})[1]
    res = []
    for i in range(runs):
        cfg = compose_config(["planner=table_wise"] + overrides)
        tasks_before = len(os.listdir("/proc/self/task"))
        cpu_before = thread_cpu()
        m = trainer.run_training(cfg, f"{out}/r{i}")
        cpu_after = thread_cpu()
        gc.collect()
        used = {f"{name}/{tid}": round(c - cpu_before.get((tid, name), 0.0), 2)
                for (tid, name), c in cpu_after.items() if c - cpu_before.get((tid, name), 0.0) > 0}
        res.append((round(m["samples_per_s"]), tasks_before, len(os.listdir("/proc/self/task")),
                    threading.active_count(), round(m["step_time_breakdown_ms"]["compute"], 1), used))
    return res


if __name__ == "__main__":
    print(run_multiprocess(worker, 2, sys.argv[1], sys.argv[2:], timeout_s=600)[0])
