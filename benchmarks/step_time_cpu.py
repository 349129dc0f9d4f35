"""Milliseconds per training step on this machine's CPU, W gloo ranks on loopback, the trainer's own model,
plan and pipeline (``build_model_and_plan`` / ``build_pipeline``): for A/B timing of a code change to the
step (swap the files between runs; interleave, the host drifts).

    python benchmarks/step_time_cpu.py [--world-size 2] [--steps 100] [--warmup 20] -- planner=herald pipeline=herald ...
"""

from __future__ import annotations

import argparse
import time
from typing import List

from torchrec_herald.dist_utils import run_multiprocess


def worker(rank: int, world: int, overrides: List[str], steps: int, warmup: int) -> float:
    """This rank's mean ms per step over ``steps`` steps after ``warmup``."""
    import torch

    from torchrec_herald.config import compose_config
    from torchrec_herald.data import build_data_source
    from torchrec_herald.trainer import build_model_and_plan, build_pipeline, train_stream

    torch.set_num_threads(1)
    cfg = compose_config(overrides + [f"data.num_train_batches={warmup + steps + 20}", "eval=false"])
    data = build_data_source(cfg.data)
    dmp, optimizer, decision = build_model_and_plan(cfg, data, world, torch.device("cpu"))
    pipeline = build_pipeline(cfg, dmp, optimizer, torch.device("cpu"), decision)
    it = train_stream(data, rank, world, cfg.batch_size)
    for _ in range(warmup):
        pipeline.progress(it)
    t0 = time.perf_counter()
    for _ in range(steps):
        pipeline.progress(it)
    return (time.perf_counter() - t0) / steps * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("overrides", nargs="*", help="Hydra overrides")
    a = ap.parse_args()
    ms = run_multiprocess(worker, a.world_size, a.overrides, a.steps, a.warmup)
    print("ms/step per rank: " + " ".join(f"{m:.2f}" for m in ms))


if __name__ == "__main__":
    main()
