"""The same training run three times in the same ranks, one after another, as ``compare_with`` runs its baseline and
then the run in one job: does a run trained second go slower for being second? (W=2, gloo, loopback.)

    python benchmarks/run_order.py OUT_DIR [Hydra overrides, e.g. eval=false]

Prints, per run: samples/s, the OS threads of rank 0 before and after it, Python threads, and its compute ms a step.
"""

from __future__ import annotations

import os
import sys
import threading
from typing import Any, List, Tuple

from torchrec_herald.dist_utils import run_multiprocess


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
        m = trainer.run_training(cfg, f"{out}/r{i}")
        gc.collect()
        res.append((round(m["samples_per_s"]), tasks_before, len(os.listdir("/proc/self/task")),
                    threading.active_count(), round(m["step_time_breakdown_ms"]["compute"], 1)))
    return res


if __name__ == "__main__":
    print(run_multiprocess(worker, 2, sys.argv[1], sys.argv[2:], timeout_s=600)[0])
