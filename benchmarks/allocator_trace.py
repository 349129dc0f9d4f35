"""Herald's input allocator on the default data: local lookup share, remote cold lookups and moved
samples per step, and the byte balance of moving samples (trace level, cost-model hot sets).

    .venv/bin/python benchmarks/allocator_trace.py [--world-sizes 2 4] [--batches 20]

Hot sets come from AccessStats of global batches 0..19 (as HeraldPlanner does); the allocators run
on the following ``--batches`` global batches. A moved sample costs its dense features (13 × 4 B),
one int64 id and one int32 length per feature and its label; a remote cold lookup costs herald's
wire format (8 + 8·dim bytes, ``planner/hot_set.py``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from torchrec_herald.data import SyntheticCriteo
from torchrec_herald.model import build_tables
from torchrec_herald.pipeline.input_allocator import (
    Locality,
    build_allocator,
    local_lookup_share,
    moved_samples,
    remote_cold_lookups,
)
from torchrec_herald.planner import AccessStats, CostModelHotSetSelector
from torchrec_herald.planner.hot_set import cold_lookup_bytes


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    p.add_argument("--batches", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=256)
    a = p.parse_args()
    data = SyntheticCriteo(num_train_batches=20 + a.batches)
    dim = 16
    tables = build_tables(data.feature_names, data.num_embeddings, dim)
    sample_bytes = data.num_dense * 4 + len(tables) * (8 + 4) + 4
    rows = []
    for W in a.world_sizes:
        G = W * a.batch_size
        batches = [b.sparse_features for b in data.train_batches(0, 1, G)]
        stats = AccessStats.from_batches(batches[:20], tables)
        hot = {n: c.hot_ids for n, c in CostModelHotSetSelector().select(stats, tables, W, a.batch_size,
                                                                           64 << 20).items()}
        loc = Locality.from_tables(tables, W, hot)
        base_remote = None
        for name, kw in (("identity", {}), ("greedy", {}), ("topk_tables", {"k": 4})):
            alloc = build_allocator(name, **kw)
            share = remote = moved = 0.0
            t0 = time.perf_counter()
            for step, kjt in enumerate(batches[20:]):
                r = alloc.assign(kjt, loc, W, step)
                share += local_lookup_share(kjt, loc, W, r)
                remote += remote_cold_lookups(kjt, loc, W, r)
                moved += moved_samples(r, W)
            n = len(batches) - 20
            remote, moved = remote / n, moved / n
            base_remote = remote if base_remote is None else base_remote
            saved = (base_remote - remote) * cold_lookup_bytes(dim)
            rows.append({"world_size": W, "allocator": name, "local_share": share / n,
                         "remote_cold_lookups_per_step": remote, "moved_samples_per_step": moved,
                         "bytes_saved_per_step": saved, "bytes_moved_per_step": moved * sample_bytes,
                         "ms_per_batch": (time.perf_counter() - t0) / n * 1e3})
    for r in rows:
        sys.stdout.write(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()}) + "\n")


if __name__ == "__main__":
    main()
