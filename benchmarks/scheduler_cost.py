"""Herald's per-step scheduler CPU time on one rank, at a simulated world size W, in one process.

What one rank of ``HeraldTrainPipeline`` computes each step besides training (collectives excluded):
(1) the allocator scores of its own B samples (``TensorLazySyncPlanner.local_scores``, one [B, W] block per
rank), (2) the greedy assignment of all W·B samples (every rank runs the same ``greedy_assign``),
(3) the sorted unique rows its allocated samples read, (4) the lazy plan of the step over all W ranks'
reads (``TensorLazySyncPlanner.plan_step``, every rank the same). Scores and reads come from the real
allocator state, the data is the default synthetic Criteo (scale 0.01), the hot set is the cost
model's for W and B, and the plan runs with the pipeline's window. Each part is timed separately.

    python benchmarks/scheduler_cost.py --world-sizes 8 64 --batch-sizes 2048 8192 --out benchmarks/results/scheduler_cost.json
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path
from typing import Any, Dict, List

import numpy as np
import torch

from machine_info import machine  # benchmarks/machine_info.py
from torchrec_herald.data import SyntheticCriteo
from torchrec_herald.model import build_tables
from torchrec_herald.pipeline.input_allocator import Locality, greedy_assign
from torchrec_herald.pipeline.lazy_sync import TensorLazySyncPlanner
from torchrec_herald.planner import AccessStats, CostModelHotSetSelector

log = logging.getLogger("scheduler_cost")


def measure(W: int, B: int, steps: int, window: int, scale: float, stats_batches: int) -> Dict[str, Any]:
    """Mean seconds per step of each scheduler part on rank 0, after the window's warm-up steps."""
    data = SyntheticCriteo(scale=scale, seed=0, zipf_alpha=1.22)
    tables = build_tables(data.feature_names, data.num_embeddings, 16, "SUM")
    G = W * B
    sample = [b.sparse_features for _, b in zip(range(stats_batches), data.train_batches(0, 1, min(G, 65536)))]
    stats = AccessStats.from_batches(sample, tables)
    hot = {n: c.hot_ids for n, c in CostModelHotSetSelector().select(stats, tables, W, B, 64 << 20).items()}
    loc = Locality.from_tables(tables, W, hot)
    planner = TensorLazySyncPlanner(loc, 0.05, window)
    offsets = loc.layout.table_offsets[torch.arange(len(tables))]  # feature f is served by table f
    F = len(tables)
    parts = {"score_own": 0.0, "assign_all": 0.0, "unique_own": 0.0, "plan_all": 0.0}
    queue: List[List[torch.Tensor]] = []
    timed = 0
    for i in range(window + steps):
        _, ids, _, _ = data.global_batch("train", i, G)
        keys = ids + offsets[:, None]  # [F, G] global row keys, one id per bag
        # every rank scores its own samples; time rank 0's share, compute the rest untimed
        t0 = time.perf_counter()
        own_sample = torch.arange(B).repeat(len(tables))  # feature-major keys of one rank's B samples
        own = planner.local_scores(keys[:, :B].reshape(-1), own_sample, B)  # [B, W]
        t1 = time.perf_counter()
        rest = [planner.local_scores(keys[:, r * B:(r + 1) * B].reshape(-1), own_sample, B) for r in range(1, W)]
        scores = torch.cat([own] + rest)
        t2 = time.perf_counter()
        rank_of = greedy_assign(scores, i)
        t3 = time.perf_counter()
        reads = []
        for r in range(W):
            mine = keys[:, rank_of == r].reshape(-1)
            ta = time.perf_counter()
            u = torch.unique_consecutive(torch.from_numpy(np.sort(mine.numpy())))
            if r == 0:
                t_unique = time.perf_counter() - ta
            reads.append(u)
        queue.append(reads)
        if len(queue) < window:
            continue
        t4 = time.perf_counter()
        planner.plan_step(queue)
        t5 = time.perf_counter()
        queue.pop(0)
        if i >= window:  # steady state: the window is full before and after
            parts["score_own"] += t1 - t0
            parts["assign_all"] += t3 - t2
            parts["unique_own"] += t_unique
            parts["plan_all"] += t5 - t4
            timed += 1
    per = {k: v / timed for k, v in parts.items()}
    total = sum(per.values())
    log.info("W=%d B=%d: %.1f ms/step (%s)", W, B, 1e3 * total, ", ".join(f"{k} {1e3 * v:.1f}" for k, v in per.items()))
    return {"world_size": W, "local_batch": B, "global_batch": G, "steps_timed": timed, "window": window,
            "scale": scale, "rows": int(planner.num_rows), "hot_rows": int(sum(h.numel() for h in hot.values())),
            "seconds_per_step": per, "total_s_per_step": total}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world-sizes", type=int, nargs="+", default=[8, 64])
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[2048, 8192])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--window", type=int, default=5)
    p.add_argument("--scale", type=float, default=0.01)
    p.add_argument("--stats-batches", type=int, default=4)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/scheduler_cost.json"))
    a = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", force=True)
    command = "python benchmarks/scheduler_cost.py " + " ".join(
        f"--{k.replace('_', '-')} {' '.join(map(str, v)) if isinstance(v, list) else v}" for k, v in vars(a).items())
    runs = []
    a.out.parent.mkdir(parents=True, exist_ok=True)
    for B in a.batch_sizes:
        for W in a.world_sizes:  # written after each run: a cut-off run keeps what it measured
            runs.append(measure(W, B, a.steps, a.window, a.scale, a.stats_batches))
            a.out.write_text(json.dumps({"machine": machine(), "command": command, "runs": runs}, indent=2))
    log.info("wrote %s", a.out)


if __name__ == "__main__":
    main()
