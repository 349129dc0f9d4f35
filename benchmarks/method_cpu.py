"""The training thread's CPU a step inside each of herald's per-step methods (hot replication's sharded EBC,
the forward-ordered dense sync, the row store's hot-row update, herald scheduling's plan executor), at W
ranks under torchrun.

On a GPU the step is bound by its host, so this is where herald's extra host time a step goes; with
``--torch-ids`` the ids and rows take the GPU's code path (torch ops, not the compiled passes). Each method is
wrapped with a ``time.thread_time`` accumulator: a method's figure includes the methods it calls (its
children are listed too), and waits for a collective cost no CPU.

    OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 benchmarks/method_cpu.py --torch-ids --batch-size 16 -- \\
        planner=herald pipeline=herald pipeline.scheduling=off planner.link_mbit=null
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from gpu_path import add_training_arguments, build_training, use_gpu_code_path  # noqa: E402

#: (module, class, methods) timed
TIMED = (
    ("torchrec_herald.sharding.hot_replicated", "ShardedHeraldEmbeddingBagCollection",
     ("input_dist", "settle_hot_sync", "_split_for_dist", "_split_ids", "_exchange_counts", "_message_for_dist",
      "_sized_by_host", "_send_ids", "compute", "output_dist", "_sync_and_update_hot", "_start_sparse_sum")),
    ("torchrec_herald.sharding.dense_sync", "ForwardOrderedDenseSync", ("start_all", "_start", "settle")),
    ("torchrec_herald.sharding.plan_exec", "PlanExecutor",
     ("prefetch", "begin", "working_set", "finish", "_route", "_start_exchange", "move_rows", "after_backward",
      "_update_rows", "_pushes_with_next_pulls", "_start_pulls", "_store_received", "before_forward")),
    ("torchrec_herald.sharding.row_store", "RowStore", ("read", "write", "apply_gradient", "receive", "payload",
                                                         "drop", "update_hot_rows")),
)


def _timed(totals: Dict[str, float], name: str, f: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(f)
    def call(*a: Any, **k: Any) -> Any:
        t = time.thread_time()
        try:
            return f(*a, **k)
        finally:
            totals[name] += time.thread_time() - t
    return call


def measure(overrides: list, batch_size: int, steps: int, warmup: int, loader: str = "stream") -> Dict[str, Any]:
    """ms of the training thread's CPU a step: in all, and inside each timed method."""
    import importlib

    totals: Dict[str, float] = collections.defaultdict(float)
    for module, cls_name, methods in TIMED:
        cls = getattr(importlib.import_module(module), cls_name)
        for m in methods:
            setattr(cls, m, _timed(totals, f"{cls_name}.{m}", getattr(cls, m)))
    rank, world, pipeline, it, _ = build_training(overrides, batch_size, warmup + steps, loader)
    for _ in range(warmup):
        pipeline.progress(it)
    totals.clear()
    t0 = time.thread_time()
    for _ in range(steps):
        pipeline.progress(it)
    per_step = 1e3 / steps
    return {"rank": rank, "world_size": world, "batch_size": batch_size, "steps": steps, "overrides": overrides,
            "loader": loader,
            "thread_cpu_ms_per_step": (time.thread_time() - t0) * per_step,
            "methods_ms_per_step": {k: v * per_step for k, v in sorted(totals.items(), key=lambda kv: -kv[1])}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_training_arguments(p, batch_size=16, steps=200, warmup=20)
    p.add_argument("--json", type=Path, help="rank 0's figures, written here")
    a = p.parse_args()
    if a.torch_ids:
        use_gpu_code_path(False)
    r = measure(a.overrides, a.batch_size, a.steps, a.warmup, a.loader)
    if r["rank"] == 0:
        print(f"training thread's CPU a step: {r['thread_cpu_ms_per_step']:.3f} ms; inside herald's methods:")
        for name, ms in r["methods_ms_per_step"].items():
            print(f"  {ms:7.3f} ms  {name}")
        if a.json:
            r["command"] = "torchrun --nproc-per-node {} benchmarks/method_cpu.py {}".format(
                r["world_size"], " ".join(sys.argv[1:]))
            a.json.parent.mkdir(parents=True, exist_ok=True)
            a.json.write_text(json.dumps(r, indent=1))


if __name__ == "__main__":
    main()
