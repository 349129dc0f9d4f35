"""Peak resident memory of each rank of a real training run at full Criteo Kaggle size (33.8 M rows).

Each configuration trains through the trainer's own ``run_training`` on fresh ranks (``data.scale=1.0``,
synthetic data, no eval), and reports ``metrics.json``'s ``peak_rss_mib_by_rank`` (``getrusage``
ru_maxrss of each rank) next to the size of all tables and of one rank's share of them.

    python benchmarks/bench_memory.py --scale 1.0 --steps 30 --out benchmarks/results/memory.json
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List

from torchrec_herald.dist_utils import run_multiprocess

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine_info import machine  # noqa: E402  (benchmarks/machine_info.py)

log = logging.getLogger("bench_memory")

CONFIGS: Dict[str, List[str]] = {
    "stock TABLE_WISE": ["planner=table_wise", "pipeline=sparse_dist"],
    "herald + scheduling": ["planner=herald", "pipeline=herald", "pipeline.scheduling=on"],
}


def _train(rank: int, world: int, overrides: List[str], run_dir: str) -> Dict[str, Any]:
    from torchrec_herald.config import compose_config
    from torchrec_herald.trainer import run_training

    m = run_training(compose_config(overrides), Path(run_dir), show_progress=False)
    return {"peak_rss_mib_by_rank": m["peak_rss_mib_by_rank"], "samples_per_s": m["samples_per_s"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--scale", type=float, default=1.0)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=2048)
    ap.add_argument("--dim", type=int, default=16)
    ap.add_argument("--configs", nargs="*", default=list(CONFIGS))
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/memory.json"))
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    from torchrec_herald.data.base import scaled_num_embeddings

    rows = sum(scaled_num_embeddings(args.scale))
    table_mib = rows * args.dim * 4 / 2**20
    common = [f"data.scale={args.scale}", f"data.num_train_batches={args.steps}", "eval=false",
              f"batch_size={args.batch_size}", f"model.embedding_dim={args.dim}",
              f"model.dense_arch=[64,{args.dim}]", "log_every=10"]
    results: Dict[str, Any] = {}
    for name in args.configs:
        t0 = time.perf_counter()
        with tempfile.TemporaryDirectory() as tmp:
            res = run_multiprocess(_train, args.world_size, common + CONFIGS[name], tmp, timeout_s=3600)
        results[name] = {"peak_rss_mib_by_rank": res[0]["peak_rss_mib_by_rank"],
                         "samples_per_s": res[0]["samples_per_s"], "wall_s": time.perf_counter() - t0}
        log.info("%s: peak RSS by rank %s MiB", name, res[0]["peak_rss_mib_by_rank"])
    out = {"command": "python " + " ".join(sys.argv), "machine": machine(), "scale": args.scale,
           "world_size": args.world_size, "steps": args.steps, "batch_size": args.batch_size, "dim": args.dim,
           "all_tables_mib": table_mib, "one_rank_share_mib": table_mib / args.world_size, "results": results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2))
    print(f"all tables ({rows} rows) {table_mib:.0f} MiB, one rank's share {table_mib / args.world_size:.0f} MiB")
    for name, r in results.items():
        print(f"{name:24s} peak RSS by rank {r['peak_rss_mib_by_rank']} MiB")


if __name__ == "__main__":
    main()
