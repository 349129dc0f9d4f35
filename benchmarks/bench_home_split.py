"""Planning by home at real size: every rank's ``HomeSplitLazyPlanner`` at W ∈ {8 … 128} on full Criteo
Kaggle cardinalities, local batch 2048, window 5 — per-rank scheduling metadata, CPU and state, next to the
embedding bytes the plan saves (issue 11's "metadata ≤ 10 % of the bytes herald saves").

One process plays all W ranks of one step in turn (samples stay where loaded: planning by home runs with
the identity allocator). Per step each rank (1) admits its reads to its caches and sends each home the
keys it reads next step and the rows it evicts, (2) as home plans its own rows and replies (one flag byte
per key, the rows to push home), (3) assembles its plan. Metadata = the int64 words of both messages
sent to other ranks; CPU = seconds of the three stages on one thread; bytes = the plan's transfers (each
counted once, at its sender) + the hot sync, as ``bench_scale.py`` counts herald full.

    python benchmarks/bench_home_split.py --world-sizes 8 32 128 --out benchmarks/results/home_split.json
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any, Dict, List

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_scale import FLOAT, INDEX, SETTINGS, default_plan_bytes  # noqa: E402
from machine_info import machine  # noqa: E402

from torchrec_herald.data import SyntheticCriteo, kjt_from_ids  # noqa: E402
from torchrec_herald.layout import RowLayout, cache_rows_for_budget  # noqa: E402
from torchrec_herald.model import build_tables  # noqa: E402
from torchrec_herald.pipeline.home_split import HomeSplitLazyPlanner, Messages, transpose_messages  # noqa: E402
from torchrec_herald.planner import AccessStats, CostModelHotSetSelector  # noqa: E402

log = logging.getLogger("bench_home_split")


def _wire_bytes(msgs: List[Messages]) -> torch.Tensor:
    """Per sending rank: int64 bytes sent to the other ranks (counts and words)."""
    return torch.tensor([8 * m.wire_words(s) for s, m in enumerate(msgs)], dtype=torch.float64)


def measure(setting: str, W: int, a: argparse.Namespace) -> Dict[str, Any]:
    B, K, dim = a.batch, a.window, a.dim
    G = W * B
    src = SyntheticCriteo(scale=SETTINGS[setting], seed=0)
    names, sizes = src.feature_names, src.num_embeddings
    tables = build_tables(names, sizes, dim, "SUM")
    stats = AccessStats.from_batches([kjt_from_ids(names, src.global_batch("train", -1 - i, G)[1][:, :min(G, 65536)])
                                      for i in range(a.stats_batches)], tables)
    choice = CostModelHotSetSelector().select(stats, tables, W, B, a.hot_budget)
    lam = {t.name: float(stats.lookups_per_step(t.name, G).sum()) for t in tables}
    layout = RowLayout.build(W, {t.name: t.num_embeddings for t in tables}, {n: c.hot_ids for n, c in choice.items()})
    row_bytes = (dim + 1) * FLOAT
    own_rows = int(layout.block_rows[0].sum())
    caps = cache_rows_for_budget(layout, int(a.cache_factor * own_rows * row_bytes), row_bytes)
    planners = [HomeSplitLazyPlanner(layout, r, window=K, capacity_rows=caps) for r in range(W)]
    offsets = layout.table_offsets.unsqueeze(1)
    queue: List[List[torch.Tensor]] = []
    cpu = torch.zeros(W, dtype=torch.float64)
    meta = torch.zeros(W, dtype=torch.float64)
    vectors, timed = 0, 0
    for i in range(K + a.steps):
        keys = src.global_batch("train", i, G)[1] + offsets  # [F, G]
        queue.append([torch.from_numpy(np.unique(keys[:, r * B:(r + 1) * B].numpy())) for r in range(W)])
        if len(queue) < K:
            continue
        t_stage = torch.zeros(W, dtype=torch.float64)
        msgs = []
        for r, p in enumerate(planners):
            t0 = time.perf_counter()
            msgs.append(p.reader_messages(queue))
            t_stage[r] += time.perf_counter() - t0
        replies = []
        for r, (p, m) in enumerate(zip(planners, transpose_messages(msgs))):
            t0 = time.perf_counter()
            replies.append(p.home_replies(m))
            t_stage[r] += time.perf_counter() - t0
        plans = []
        for r, (p, m) in enumerate(zip(planners, transpose_messages(replies))):
            t0 = time.perf_counter()
            plans.append(p.assemble(m))
            t_stage[r] += time.perf_counter() - t0
        queue.pop(0)
        if i >= K:
            cpu += t_stage
            meta += _wire_bytes(msgs) + _wire_bytes(replies)
            vectors += sum(p.counters.vectors for p in plans)
            timed += 1
    cpu, meta = cpu / timed, meta / timed
    hot_sync = sum(c.expected.herald_hot_sync for c in choice.values())
    herald = vectors / timed * (dim * FLOAT + INDEX) + hot_sync
    default = default_plan_bytes(tables, W, B, lam, dim)
    saved = (default - herald) / W
    out = {"setting": setting, "world_size": W, "local_batch": B, "window": K, "steps_timed": timed,
           "hot_rows": layout.num_hot, "metadata_bytes_per_rank_step": {"mean": float(meta.mean()), "max": float(meta.max())},
           "scheduler_cpu_s_per_rank_step": {"mean": float(cpu.mean()), "max": float(cpu.max())},
           "state_bytes_per_rank": {"mean": float(np.mean([p.state_bytes() for p in planners])),
                                    "max": float(max(p.state_bytes() for p in planners))},
           "embedding_bytes_per_step": {"stock_default_plan": default, "herald_by_home": herald},
           "herald_saves_per_rank_step": saved,
           "metadata_share_of_saving": {"mean": float(meta.mean()) / saved, "max": float(meta.max()) / saved}}
    log.info("%s W=%d: metadata %.2f MiB/rank/step (max %.2f) vs saved %.2f MiB: %.1f %% (max %.1f %%); "
             "cpu %.3f s (max %.3f); state %.1f MiB (max %.1f)", setting, W, meta.mean() / 2**20, meta.max() / 2**20,
             saved / 2**20, 100 * out["metadata_share_of_saving"]["mean"], 100 * out["metadata_share_of_saving"]["max"],
             cpu.mean(), cpu.max(), out["state_bytes_per_rank"]["mean"] / 2**20, out["state_bytes_per_rank"]["max"] / 2**20)
    return out


def plot(runs: List[Dict[str, Any]], scale_json: Path, path: Path) -> None:
    """Metadata share, CPU and plan state per rank vs W: planning by home against global planning
    (``bench_scale.py``'s Kaggle rows, when ``scale_json`` exists)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    glob = ([r for r in json.loads(scale_json.read_text())["runs"] if r["setting"] == "kaggle"]
            if scale_json.exists() else [])
    glob.sort(key=lambda r: r["world_size"])
    runs = sorted(runs, key=lambda r: r["world_size"])
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.2))
    W = [r["world_size"] for r in runs]
    Wg = [r["world_size"] for r in glob]
    series = (
        ([100 * r["metadata_share_of_saving"]["max"] for r in runs], [100 * r["metadata_share_of_saving"] for r in glob]),
        ([r["scheduler_cpu_s_per_rank_step"]["max"] for r in runs], [r["scheduler_cpu_s_total"] for r in glob]),
        ([r["state_bytes_per_rank"]["max"] / 2**20 for r in runs], [r["scheduler_state_bytes"] / 2**20 for r in glob]),
    )
    titles = ("scheduling metadata / embedding bytes saved", "scheduler CPU per rank and step (one thread)",
              "plan state per rank")
    for ax, (home, g), title, ylabel in zip(axes, series, titles, ("%", "s", "MiB")):
        if glob:
            ax.plot(Wg, g, "s--", color="tab:red", label="every rank plans everything (bench_scale)")
        ax.plot(W, home, "o-", color="tab:blue", label="planning by home (max over ranks)")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("ranks W")
        ax.set_ylabel(ylabel)
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
    axes[0].axhline(10, color="gray", ls=":", label="10 % target")
    for ax in axes:
        ax.legend(fontsize=8)
    fig.suptitle("Full Criteo Kaggle, local batch 2048, window 5, dim 16")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    log.info("wrote %s", path)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world-sizes", type=int, nargs="+", default=[8, 32, 128])
    p.add_argument("--settings", nargs="+", default=["kaggle"], choices=sorted(SETTINGS))
    p.add_argument("--batch", type=int, default=2048)
    p.add_argument("--window", type=int, default=5)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--stats-batches", type=int, default=4)
    p.add_argument("--hot-budget", type=int, default=64 << 20)
    p.add_argument("--cache-factor", type=float, default=1.0)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/home_split.json"))
    p.add_argument("--scale-json", type=Path, default=Path("benchmarks/results/scale.json"),
                   help="bench_scale.py's results, drawn for comparison")
    p.add_argument("--plot-only", action="store_true", help="redraw the plot of --out, measure nothing")
    a = p.parse_args()
    if a.plot_only:
        plot(json.loads(a.out.read_text())["runs"], a.scale_json, a.out.with_suffix(".png"))
        return
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s", force=True)
    log.setLevel(logging.INFO)
    torch.set_num_threads(1)
    runs = []
    for setting in a.settings:
        for W in a.world_sizes:
            runs.append(measure(setting, W, a))
            a.out.write_text(json.dumps({"machine": machine(), "command": "python " + " ".join(sys.argv),
                                         "runs": runs}, indent=2))
    plot(runs, a.scale_json, a.out.with_suffix(".png"))


if __name__ == "__main__":
    main()
