"""What the per-batch check of a loader of each rank's own batches costs a step: the wall time of
``describe_own_batch`` and ``settle_own_batch`` (one fixed-size gather of every rank's batch description,
before any exchange sized by the batch), beside the step's wall time, at W ranks under torchrun.

Each batch's gather is started as the batch before it is handed over and waited for when the batch is
read, a step later (``CheckedOwnBatches``): with scheduling on, on the run-ahead thread; with it off, on
the training thread, when TorchRec's pipeline reads a batch. The trainer's own loader (whole global
batches) has no such check: it is not timed here.

    OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 benchmarks/own_batch_check.py --steps 100 -- \\
        planner=herald pipeline=herald planner.link_mbit=null pipeline.scheduling=off

The check's wall time includes waiting for the slowest rank, a wait the step's next collective would
otherwise take; ``--without-check`` gives the step without it, for an A/B of the step time.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Dict

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from gpu_path import add_training_arguments, build_training  # noqa: E402


def _timed(totals: Dict[str, float], f: Callable[..., Any]) -> Callable[..., Any]:
    """``f`` with its wall time added to ``totals``, by thread: the training thread's or the run-ahead one's."""
    @functools.wraps(f)
    def call(*a: Any, **k: Any) -> Any:
        t = time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            key = "training_thread" if threading.current_thread() is threading.main_thread() else "other_threads"
            totals[key] += time.perf_counter() - t
    return call


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_training_arguments(p, batch_size=256, steps=100, warmup=10)
    p.add_argument("--json", type=Path, help="rank 0's figures, written here")
    p.add_argument("--without-check", action="store_true",
                   help="the step with the check taken out (a dry loader then leaves the others waiting): the A/B")
    a = p.parse_args()
    import torch

    import torchrec_herald.pipeline.stages.keys as keys
    from torchrec_herald.pipeline.stages.keys import OwnBatchDescriptions

    totals: Dict[str, float] = {"training_thread": 0.0, "other_threads": 0.0}
    if a.without_check:  # every batch taken as it comes, as before the check
        keys.describe_own_batch = lambda env, raw, index: OwnBatchDescriptions(raw, index, torch.empty(0))
        keys.settle_own_batch = lambda env, described: described.raw is not None
    for name in ("describe_own_batch", "settle_own_batch"):  # (what CheckedOwnBatches calls)
        setattr(keys, name, _timed(totals, getattr(keys, name)))
    rank, world, pipeline, it, _ = build_training(a.overrides, a.batch_size, a.warmup + a.steps, "own")
    for _ in range(a.warmup):
        pipeline.progress(it)
    for k in totals:
        totals[k] = 0.0
    t0 = time.perf_counter()
    for _ in range(a.steps):
        pipeline.progress(it)
    wall = time.perf_counter() - t0
    r = {"world_size": world, "batch_size": a.batch_size, "steps": a.steps, "overrides": a.overrides,
         "check": not a.without_check,
         "step_ms": 1e3 * wall / a.steps,
         "check_ms_per_step": {k: 1e3 * v / a.steps for k, v in totals.items()},
         "command": "torchrun --nproc-per-node {} benchmarks/own_batch_check.py {}".format(world, " ".join(sys.argv[1:]))}
    if rank == 0:
        print(f"step {r['step_ms']:.2f} ms; the own-batch check a step: {r['check_ms_per_step']['training_thread']:.3f} ms "
              f"on the training thread, {r['check_ms_per_step']['other_threads']:.3f} ms on others")
        if a.json:
            a.json.parent.mkdir(parents=True, exist_ok=True)
            a.json.write_text(json.dumps(r, indent=1))


if __name__ == "__main__":
    main()
