"""Herald at real size: one rank's scheduler at W ∈ {8 … 128} on full Criteo Kaggle cardinalities (33.8 M
rows) and a 10× larger, Terabyte-like setting — memory, CPU time and metadata per step, bytes per step of
every plan, and a projected step time.

One process plays one rank of ``HeraldTrainPipeline`` with ``global_batches`` (the default): per step it
keys the whole global batch, scores every sample for every rank (``TensorLazySyncPlanner.local_scores``),
runs the greedy assignment, forms every rank's sorted unique reads and plans the step over the window
(``plan_step``) — the project's own code, as every rank runs it. Hot sets come from the cost model
(``CostModelHotSetSelector``, the planner's hot-memory budget) on ``AccessStats`` of the first global
batches; cache capacity is a bytes budget per rank (``pipeline.cache_bytes``), by default as many rows as
the rank's own block (``--cache-factor 1``).

Reported per (setting, W):
- scheduler memory: the planner's state (``state_bytes``), the window's read sets, and the peak RSS
  above the RSS before the first batch (everything the scheduler allocates, the batches' ids included;
  the process runs with ``MALLOC_MMAP_THRESHOLD_=65536`` so freed tensors leave the RSS);
- scheduler CPU seconds per step, by part (score, assign, reads, plan), mean over the timed steps;
- metadata bytes per rank and step: with global batches no collective carries scheduling metadata, but
  each rank reads every other rank's sample ids from the data source, ``(W−1)·B·F·4`` bytes; the per-rank
  path would all-gather int16 scores ``[G, W]`` and every rank's int32 read set instead;
- embedding bytes per step (all ranks): stock TABLE_WISE / ROW_WISE / TorchRec's default plan and herald
  hot replication alone (the planner's traffic model, ``planner/hot_set.py``), herald full (the plan's
  measured transfers + the hot sync);
- projected step time per rank, stock default plan vs herald full, from a compute + bandwidth model
  (:func:`project_ms`) calibrated on this machine's measured runs (``benchmarks/results/bandwidth.json``).

Ids come from the synthetic generator (``--ids synthetic``) or from a trace recorded in a run of the
trainer's data source (``--ids trace --trace FILE``; record one with ``--record-trace FILE``).

    python benchmarks/bench_scale.py --world-sizes 8 16 32 64 128 --settings kaggle terabyte \\
        --out benchmarks/results/scale.json
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from checkpoint_memory import PeakRSS, rss_bytes  # noqa: E402  (benchmarks/checkpoint_memory.py)
from machine_info import machine  # noqa: E402  (benchmarks/machine_info.py)

from torchrec_herald.data import SyntheticCriteo, kjt_from_ids  # noqa: E402
from torchrec_herald.layout import RowLayout, cache_rows_for_budget  # noqa: E402
from torchrec_herald.model import build_tables  # noqa: E402
from torchrec_herald.pipeline.input_allocator import greedy_assign  # noqa: E402
from torchrec_herald.pipeline.lazy_sync import TensorLazySyncPlanner  # noqa: E402
from torchrec_herald.planner import AccessStats, CostModelHotSetSelector  # noqa: E402
from torchrec_herald.planner.hot_set import stock_row_wise_bytes, stock_table_wise_bytes  # noqa: E402
from torchrec_herald.planner.pricing import HERALD_COLLECTIVES, STOCK_TW_COLLECTIVES  # noqa: E402

log = logging.getLogger("bench_scale")

SETTINGS = {"kaggle": 1.0, "terabyte": 10.0}  # data.scale: Kaggle cardinalities × scale
FLOAT, INDEX = 4, 4


class Trace:
    """Global batches of ids cut from a recorded trace (``[samples, F]`` int64), wrapping around."""

    def __init__(self, path: Path) -> None:
        blob = torch.load(path)
        self.ids: torch.Tensor = blob["ids"]
        self.num_embeddings: List[int] = blob["num_embeddings"]
        self.feature_names: List[str] = blob["feature_names"]

    def global_batch(self, index: int, size: int) -> torch.Tensor:
        n = self.ids.shape[0]
        rows = (torch.arange(size) + index * size) % n
        return self.ids.index_select(0, rows).T.contiguous()  # [F, G]


def record_trace(path: Path, overrides: List[str], samples: int) -> None:
    """Record ``samples`` samples' ids from the trainer's data source (Hydra ``overrides``)."""
    from torchrec_herald.config import compose_config
    from torchrec_herald.trainer import preflight

    data = preflight(compose_config(overrides))
    out, n = [], 0
    for batch in data.train_batches(0, 1, min(samples, 65536)):
        kjt = batch.sparse_features
        lengths = kjt.lengths().view(len(kjt.keys()), -1)
        if bool((lengths != 1).any()):
            raise ValueError("the trace recorder takes one id per feature and sample")
        out.append(kjt.values().view(len(kjt.keys()), -1).T.to(torch.int64))
        n += out[-1].shape[0]
        if n >= samples:
            break
    torch.save({"ids": torch.cat(out)[:samples], "num_embeddings": list(data.num_embeddings),
                "feature_names": list(data.feature_names), "overrides": overrides}, path)
    log.info("recorded %d samples to %s", min(n, samples), path)


def calibration(path: Path) -> Dict[str, float]:
    """Compute per sample (stock TABLE_WISE's compute at an unlimited link, 2 ranks) from bandwidth.json."""
    rows = json.loads(path.read_text())["rows"]
    tw = [r for r in rows if r["config"] == "tw" and r["rate_mbit"] == 0 and r["world_size"] == 2]
    batch = 256  # bench_bandwidth's local batch
    return {"compute_ms_per_sample": tw[0]["breakdown_ms"]["compute"] / batch, "source": str(path),
            "from": "stock TABLE_WISE compute at W=2, unlimited link, local batch 256"}


def project_ms(compute_ms: float, bytes_per_rank: float, collectives: int, link_mbit: float, latency_ms: float,
               herald_cpu_ms: float = 0.0, scheduler_ms: float = 0.0) -> float:
    """Projected step time of one rank: compute + link time of its bytes + collectives × latency (+ herald's
    extra CPU); herald's scheduler runs ahead in its own thread and shows only where it is slower than
    the step it serves."""
    step = compute_ms + herald_cpu_ms + bytes_per_rank * 8 / (link_mbit * 1e3) + collectives * latency_ms
    return max(step, scheduler_ms)


def projections(run: Dict[str, Any], cal: Dict[str, float], a: argparse.Namespace) -> Dict[str, Dict[str, float]]:
    """Projected step ms per link rate: stock (its default plan, else TABLE_WISE), herald hot replication
    alone (no scheduler) and herald full (its scheduler's measured CPU time as the floor)."""
    W, e = run["world_size"], run["embedding_bytes_per_step"]
    stock = e["stock_default_plan"] if e["stock_default_plan"] is not None else e["stock_table_wise"]
    compute_ms = cal["compute_ms_per_sample"] * run["local_batch"]
    extra_cpu_ms = a.cpu_us_per_lookup * run["lookups_per_rank_step"] / 1e3
    out = {}
    for link in a.links:
        stock_ms = project_ms(compute_ms, stock / W, STOCK_TW_COLLECTIVES, link, a.latency_ms)
        hot_ms = project_ms(compute_ms, e["herald_hot_only"] / W, HERALD_COLLECTIVES, link, a.latency_ms, extra_cpu_ms)
        full_ms = project_ms(compute_ms, e["herald_full"] / W, HERALD_COLLECTIVES, link, a.latency_ms, extra_cpu_ms,
                             1e3 * run["scheduler_cpu_s_total"])
        out[f"{link:g}"] = {"stock_ms": stock_ms, "herald_hot_only_ms": hot_ms, "herald_full_ms": full_ms,
                            "hot_only_speedup": stock_ms / hot_ms, "full_speedup": stock_ms / full_ms}
    return out


def default_plan_bytes(tables: List[Any], W: int, B: int, lam: Dict[str, float], dim: int) -> Optional[float]:
    """Bytes per step of TorchRec's default plan for these tables at W ranks (its planner on a meta model),
    priced with the same formulas; None if the stock planner cannot plan it."""
    from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology

    from torchrec_herald.model import build_dlrm_train
    from torchrec_herald.sharding.stock import CpuEmbeddingBagCollectionSharder

    try:
        model = build_dlrm_train(tables, 13, [64, dim], [64, 1], device="meta")
        plan = EmbeddingShardingPlanner(topology=Topology(world_size=W, compute_device="cpu"),
                                        batch_size=B).plan(model, [CpuEmbeddingBagCollectionSharder()])
    except Exception as e:  # the stock planner's own limits (e.g. storage): reported as missing
        log.warning("stock default plan at W=%d: %s", W, e)
        return None
    total = 0.0
    for per_module in plan.plan.values():
        for name, ps in per_module.items():
            t = next(t for t in tables if t.name == name)
            if ps.sharding_type == "row_wise":
                total += stock_row_wise_bytes(lam[name], W * B, W, dim)
            elif ps.sharding_type == "data_parallel":
                total += 2 * (W - 1) * t.num_embeddings * dim * FLOAT  # ring all-reduce of the whole table
            else:  # table_wise / column_wise: a table's lookups go to its rank(s)
                total += stock_table_wise_bytes(lam[name], W * B, W, dim)
    return total


def measure(setting: str, W: int, a: argparse.Namespace, cal: Dict[str, float]) -> Dict[str, Any]:
    """One rank's scheduler at ``W`` ranks on ``setting`` (see the module docstring)."""
    B, K, dim = a.batch, a.window, a.dim
    G = W * B
    if a.ids == "trace":
        src: Any = Trace(a.trace)
        names, sizes = src.feature_names, src.num_embeddings
    else:
        src = SyntheticCriteo(scale=SETTINGS[setting], seed=0)
        names, sizes = src.feature_names, src.num_embeddings
    tables = build_tables(names, sizes, dim, "SUM")
    F = len(tables)

    def batch_ids(i: int) -> torch.Tensor:  # [F, G] ids of global batch i
        return src.global_batch(i, G) if a.ids == "trace" else src.global_batch("train", i, G)[1]

    t0 = time.perf_counter()
    stats = AccessStats.from_batches([kjt_from_ids(names, batch_ids(-1 - i)[:, :min(G, 65536)])
                                      for i in range(a.stats_batches)], tables)
    stats_s = time.perf_counter() - t0
    choice = CostModelHotSetSelector().select(stats, tables, W, B, a.hot_budget)
    lam = {t.name: float(stats.lookups_per_step(t.name, G).sum()) for t in tables}
    layout = RowLayout.build(W, {t.name: t.num_embeddings for t in tables}, {n: c.hot_ids for n, c in choice.items()})
    own_rows = int(layout.block_rows[0].sum())
    row_bytes = (dim + 1) * FLOAT
    cache_bytes = int(a.cache_factor * own_rows * row_bytes)
    planner = TensorLazySyncPlanner(layout, window=K, capacity_rows=cache_rows_for_budget(layout, cache_bytes, row_bytes))
    offsets = layout.table_offsets.unsqueeze(1)  # feature f is served by table f
    N = layout.num_rows
    parts = {"score": 0.0, "assign": 0.0, "reads": 0.0, "plan": 0.0}
    plan_vectors, timed, window_bytes, state_bytes = 0, 0, 0, 0
    queue: List[List[torch.Tensor]] = []
    rss_before = rss_bytes()
    with PeakRSS() as peak:
        for i in range(K + a.steps):
            keys = (batch_ids(i) + offsets).reshape(-1)  # feature-major: key j belongs to sample j % G
            sample = torch.arange(G).repeat(F)
            c0 = time.perf_counter()
            scores = planner.local_scores(keys, sample, G)
            c1 = time.perf_counter()
            rank_of = greedy_assign(scores, i)
            c2 = time.perf_counter()
            both = torch.from_numpy(np.unique((rank_of.index_select(0, sample) * N + keys).numpy()))
            reads = [part - r * N for r, part in enumerate(both.split(torch.bincount(both // N, minlength=W).tolist()))]
            c3 = time.perf_counter()
            del scores, both, keys, sample
            queue.append(reads)
            if len(queue) < K:
                continue
            plan = planner.plan_step(queue)
            c4 = time.perf_counter()
            window_bytes = max(window_bytes, sum(r.numel() * 8 for w in queue for r in w))
            queue.pop(0)
            if i >= K:  # steady state: the window was full before and after
                for k, dt in zip(parts, (c1 - c0, c2 - c1, c3 - c2, c4 - c3)):
                    parts[k] += dt
                plan_vectors += plan.counters.vectors
                timed += 1
            state_bytes = max(state_bytes, planner.state_bytes())
    per = {k: v / timed for k, v in parts.items()}
    cpu_s = sum(per.values())
    # bytes per step, all ranks
    herald_hot = sum(c.expected.herald_total for c in choice.values())
    hot_sync = sum(c.expected.herald_hot_sync for c in choice.values())
    herald_full = plan_vectors / timed * (dim * FLOAT + INDEX) + hot_sync
    tw = sum(stock_table_wise_bytes(lam[t.name], G, W, dim) for t in tables)
    rw = sum(stock_row_wise_bytes(lam[t.name], G, W, dim) for t in tables)
    default = default_plan_bytes(tables, W, B, lam, dim) if a.default_plan else None
    stock_ref = default if default is not None else tw
    saved_per_rank = (stock_ref - herald_full) / W
    metadata_global = (W - 1) * B * F * INDEX
    unique_reads_per_rank = sum(r.numel() for w in queue for r in w) / max(len(queue), 1) / W
    metadata_per_rank_path = G * W * 2 + (W - 1) * unique_reads_per_rank * INDEX
    out = {
        "setting": setting, "ids": a.ids, "world_size": W, "local_batch": B, "global_batch": G, "window": K,
        "rows": N, "hot_rows": layout.num_hot, "own_rows": own_rows, "cache_bytes_per_rank": cache_bytes,
        "cache_entries": len(planner.entries), "dirty_rows": len(planner.dirty), "steps_timed": timed,
        "access_stats_s": stats_s,
        "scheduler_state_bytes": state_bytes, "window_read_bytes": window_bytes,
        "scheduler_peak_rss_bytes": peak.peak - rss_before, "rss_before_bytes": rss_before,
        "scheduler_cpu_s_per_step": per, "scheduler_cpu_s_total": cpu_s,
        "metadata_bytes_per_rank_step": {"global_batches_ids_read": metadata_global,
                                         "per_rank_path_scores_and_reads": metadata_per_rank_path},
        "embedding_bytes_per_step": {"stock_table_wise": tw, "stock_row_wise": rw, "stock_default_plan": default,
                                     "herald_hot_only": herald_hot, "herald_full": herald_full},
        "herald_saves_per_rank_step": saved_per_rank,
        "metadata_share_of_saving": metadata_global / saved_per_rank if saved_per_rank > 0 else math.inf,
        "lookups_per_rank_step": sum(lam.values()) / W,
    }
    out["projected_step_ms"] = projections(out, cal, a)
    log.info("%s W=%d: state %.0f MiB, peak +%.0f MiB, cpu %.2f s/step (%s); metadata %.1f MiB vs saved %.2f MiB",
             setting, W, state_bytes / 2**20, out["scheduler_peak_rss_bytes"] / 2**20, cpu_s,
             ", ".join(f"{k} {v:.2f}" for k, v in per.items()), metadata_global / 2**20, saved_per_rank / 2**20)
    return out


def plot(runs: List[Dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, grid = plt.subplots(2, 2, figsize=(12, 8))
    axes = grid.flatten()
    for setting in sorted({r["setting"] for r in runs}):
        rs = sorted((r for r in runs if r["setting"] == setting), key=lambda r: r["world_size"])
        W = [r["world_size"] for r in rs]
        axes[0].plot(W, [r["scheduler_peak_rss_bytes"] / 2**30 for r in rs], "o-", label=f"{setting}: peak RSS")
        axes[0].plot(W, [r["scheduler_state_bytes"] / 2**30 for r in rs], "s--", label=f"{setting}: plan state")
        axes[1].plot(W, [r["scheduler_cpu_s_total"] for r in rs], "o-", label=setting)
        axes[2].plot(W, [r["metadata_share_of_saving"] * 100 for r in rs], "o-", label=setting)
        link = next(iter(rs[0]["projected_step_ms"]))
        axes[3].plot(W, [r["projected_step_ms"][link]["hot_only_speedup"] for r in rs], "o-",
                     label=f"{setting}: hot replication alone")
        axes[3].plot(W, [r["projected_step_ms"][link]["full_speedup"] for r in rs], "s--",
                     label=f"{setting}: herald full (scheduler-bound)")
    axes[0].axhline(1.0, color="gray", ls=":", label="1 GiB target")
    axes[2].axhline(10, color="gray", ls=":", label="10 % target")
    axes[3].axhline(1.0, color="gray", ls=":", label="stock")
    titles = ("scheduler memory per rank", "scheduler CPU per step (one thread, this machine)",
              "ids read per rank / embedding bytes it saves", f"projected speedup vs stock ({link} Mbit/s)")
    for ax, title, ylabel in zip(axes, titles, ("GiB", "s", "%", "× stock")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("ranks W")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    for ax in axes[1:]:
        ax.set_yscale("log")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    log.info("wrote %s", path)


def table(runs: List[Dict[str, Any]]) -> str:
    """The RESULTS.md table of ``runs``."""
    mib = 2 ** 20
    head = ("| setting | W | hot rows | plan state MiB | window MiB | peak RSS +MiB | scheduler CPU s/step "
            "(score/assign/reads/plan) | ids read MiB/step | herald saves MiB/step/rank | stock TW / RW / default / "
            "herald hot / herald full, MiB/step all ranks | projected vs stock: hot only · full, 10 / 1 Gbit/s |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|\n")
    rows = []
    for r in runs:
        e, c, m = r["embedding_bytes_per_step"], r["scheduler_cpu_s_per_step"], r["metadata_bytes_per_rank_step"]
        default = "–" if e["stock_default_plan"] is None else f"{e['stock_default_plan'] / mib:.0f}"
        proj = " / ".join(f"{v['hot_only_speedup']:.2f}× · {v['full_speedup']:.2f}×" for v in r["projected_step_ms"].values())
        rows.append(f"| {r['setting']} | {r['world_size']} | {r['hot_rows']} | {r['scheduler_state_bytes'] / mib:.0f} | "
                    f"{r['window_read_bytes'] / mib:.0f} | {r['scheduler_peak_rss_bytes'] / mib:.0f} | "
                    f"{r['scheduler_cpu_s_total']:.2f} ({c['score']:.2f}/{c['assign']:.2f}/{c['reads']:.2f}/{c['plan']:.2f}) | "
                    f"{m['global_batches_ids_read'] / mib:.1f} | {r['herald_saves_per_rank_step'] / mib:.2f} | "
                    f"{e['stock_table_wise'] / mib:.0f} / {e['stock_row_wise'] / mib:.0f} / {default} / "
                    f"{e['herald_hot_only'] / mib:.0f} / {e['herald_full'] / mib:.0f} | {proj} |")
    return head + "\n".join(rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world-sizes", type=int, nargs="+", default=[8, 16, 32, 64, 128])
    p.add_argument("--settings", nargs="+", default=["kaggle", "terabyte"], choices=sorted(SETTINGS))
    p.add_argument("--batch", type=int, default=2048, help="local batch")
    p.add_argument("--window", type=int, default=5)
    p.add_argument("--steps", type=int, default=3, help="timed steps after the window fills")
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--stats-batches", type=int, default=4)
    p.add_argument("--hot-budget", type=int, default=64 << 20, help="hot replica bytes per rank (planner default)")
    p.add_argument("--cache-factor", type=float, default=1.0, help="cache rows per rank / own block rows")
    p.add_argument("--ids", choices=["synthetic", "trace"], default="synthetic")
    p.add_argument("--trace", type=Path)
    p.add_argument("--record-trace", type=Path, help="record a trace from the trainer's data source and exit")
    p.add_argument("--record-samples", type=int, default=1 << 20)
    p.add_argument("--overrides", nargs="*", default=[], help="Hydra overrides of the recorded data source")
    p.add_argument("--links", type=float, nargs="+", default=[10000.0, 1000.0], help="Mbit/s for the projection")
    p.add_argument("--latency-ms", type=float, default=0.02, help="per collective, a fabric's")
    p.add_argument("--cpu-us-per-lookup", type=float, default=0.6)
    p.add_argument("--no-default-plan", dest="default_plan", action="store_false")
    p.add_argument("--calibration", type=Path, default=Path("benchmarks/results/bandwidth.json"))
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/scale.json"))
    p.add_argument("--report-only", action="store_true", help="plot and print the table of --out, measure nothing")
    a = p.parse_args()
    if os.environ.get("MALLOC_MMAP_THRESHOLD_") is None:
        # large blocks straight from mmap, returned on free: RSS then follows the live tensors (glibc)
        os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"
        os.execv(sys.executable, [sys.executable] + sys.argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s", force=True)
    log.setLevel(logging.INFO)  # (the stock planner's tables and notes stay quiet)
    if a.record_trace:
        record_trace(a.record_trace, a.overrides, a.record_samples)
        return
    if a.report_only:  # redraw the plot and print the table from --out (projections recomputed)
        blob = json.loads(a.out.read_text())
        runs = blob["runs"]
        for r in runs:
            if "lookups_per_rank_step" in r:
                r["projected_step_ms"] = projections(r, blob["calibration"], a)
        plot(runs, a.out.with_suffix(".png"))
        print(table(runs))
        return
    if a.ids == "trace" and a.trace is None:
        p.error("--ids trace needs --trace FILE (record one with --record-trace FILE)")
    torch.set_num_threads(1)  # one rank's scheduler thread
    cal = calibration(a.calibration)
    runs: List[Dict[str, Any]] = []
    a.out.parent.mkdir(parents=True, exist_ok=True)
    for setting in (a.settings if a.ids == "synthetic" else ["trace"]):
        for W in a.world_sizes:  # written after each run: a cut-off run keeps what it measured
            runs.append(measure(setting, W, a, cal))
            a.out.write_text(json.dumps({"machine": machine(), "command": "python " + " ".join(sys.argv),
                                         "calibration": cal, "runs": runs}, indent=2, default=str))
    plot(runs, a.out.with_suffix(".png"))
    print(table(runs))


if __name__ == "__main__":
    main()
