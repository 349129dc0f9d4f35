"""Per-rank memory of a checkpoint save and load at full Criteo Kaggle size (``data.scale=1.0``, 33.8 M rows).

Each rank builds the trainer's model and plan (``build_model_and_plan``), trains a few steps, then saves a
DCP checkpoint (``torchrec_herald.checkpoint.save_checkpoint``) and loads it back
(``load_checkpoint``). A thread samples the process's resident memory (``/proc/self/status`` VmRSS)
every 2 ms; the figures are the peak above the RSS just before each operation, next to the size of a
full table set and of the rank's own shards, so "no table materialized" can be read off.

    python benchmarks/checkpoint_memory.py [--planner herald|table_wise] [--scale 1.0] [--out ...]
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Dict, List

from torchrec_herald.dist_utils import run_multiprocess

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine_info import machine  # noqa: E402  (benchmarks/machine_info.py)

log = logging.getLogger("checkpoint_memory")


def rss_bytes() -> int:
    """This process's resident set size (Linux ``/proc/self/status``)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


class PeakRSS:
    """Context manager: the peak RSS above the RSS at entry, sampled every ``period`` seconds."""

    def __init__(self, period: float = 0.002) -> None:
        self.period, self.peak, self.base = period, 0, 0

    def __enter__(self) -> "PeakRSS":
        self.base = self.peak = rss_bytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_bytes())
            time.sleep(self.period)

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_bytes())

    @property
    def extra(self) -> int:
        return self.peak - self.base


def _worker(rank: int, world: int, overrides: List[str], root: str, steps: int) -> Dict[str, Any]:
    import torch
    from torchrec.distributed.train_pipeline import TrainPipelineSparseDist

    from torchrec_herald.checkpoint import load_checkpoint, save_checkpoint
    from torchrec_herald.config import compose_config
    from torchrec_herald.data import build_data_source
    from torchrec_herald.trainer import build_model_and_plan

    cfg = compose_config(overrides)
    data = build_data_source(cfg.data)
    t0 = time.perf_counter()
    dmp, optimizer, _ = build_model_and_plan(cfg, data, world, torch.device("cpu"))
    build_s = time.perf_counter() - t0
    pipe = TrainPipelineSparseDist(dmp, optimizer, torch.device("cpu"))
    it = data.train_batches(rank, world, cfg.batch_size)
    for _ in range(steps):
        pipe.progress(it)
    rows = sum(data.num_embeddings)
    dim = cfg.model.embedding_dim
    local = sum(sh.tensor.numel() * 4 for k, v in dmp.state_dict().items() if "embedding_bags" in k
                for sh in (v.local_shards() if hasattr(v, "local_shards") else []))
    rss_before = rss_bytes()
    t0 = time.perf_counter()
    with PeakRSS() as save:
        path = save_checkpoint(Path(root), steps, dmp, optimizer, {"bench": True})
    save_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    with PeakRSS() as load:
        load_checkpoint(path, dmp, optimizer)
    load_s = time.perf_counter() - t0
    return {"rank": rank, "rows": rows, "dim": dim, "all_tables_bytes": rows * dim * 4, "own_shard_bytes": local,
            "rss_before_save_bytes": rss_before, "save_peak_extra_bytes": save.extra, "load_peak_extra_bytes": load.extra,
            "save_s": save_s, "load_s": load_s, "build_s": build_s}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--planner", default="herald")
    p.add_argument("--scale", type=float, default=1.0)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/checkpoint_memory.json"))
    a = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", force=True)
    overrides = [f"planner={a.planner}", f"data.scale={a.scale}", "data.num_train_batches=50", "eval=false",
                 "planner.stats_batches=4"] if a.planner == "herald" else \
        [f"planner={a.planner}", f"data.scale={a.scale}", "data.num_train_batches=50", "eval=false"]
    with tempfile.TemporaryDirectory(dir=".") as root:
        runs = run_multiprocess(_worker, a.world_size, overrides, root, a.steps, timeout_s=3000)
    mib = 1 << 20
    for r in runs:
        log.info("rank %d: all tables %.0f MiB, own shards %.0f MiB, RSS before save %.0f MiB; save +%.0f MiB "
                 "(%.1f s), load +%.0f MiB (%.1f s)", r["rank"], r["all_tables_bytes"] / mib, r["own_shard_bytes"] / mib,
                 r["rss_before_save_bytes"] / mib, r["save_peak_extra_bytes"] / mib, r["save_s"],
                 r["load_peak_extra_bytes"] / mib, r["load_s"])
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps({"machine": machine(), "command": "python benchmarks/checkpoint_memory.py " +
                                 " ".join(sys.argv[1:]), "overrides": overrides, "runs": runs}, indent=2))
    log.info("wrote %s", a.out)


if __name__ == "__main__":
    main()
