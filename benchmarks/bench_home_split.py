"""Planning by home at real size: every rank's planner by home (compiled, and the Python reference where
asked) at W ∈ {8 … 128} on full Criteo Kaggle cardinalities and 10× them, local batch 2048 and 8192,
window 5, dims 16 and 128: per rank and step the scheduler CPU, the metadata on the wire and its share
of the embedding bytes herald saves, and the plan state (with ``--fill``: run on until every cache is
full, report the step it filled at, the state then, and the CPU per step with full caches).

One process plays all W ranks of one step in turn (samples stay where loaded: by home the input allocator
is off). Per step each rank (1) admits its reads to its caches and sends each home the keys it reads next
step and the rows it evicts, (2) as home plans its own rows and replies (one flag byte per key, the rows
to push home), (3) assembles its plan. Metadata = the int64 words of both messages sent to other ranks;
CPU = seconds of the three stages on one thread; bytes = the plan's transfers (each counted once, at its
sender) + the hot sync, as ``bench_scale.py`` counts herald full.

Critical path: by home the pipeline runs all three stages and both exchanges in its scheduler thread while
the previous step trains (``run_ahead``, the default), so this CPU is off the step's critical path; the
step waits only when the scheduler takes longer than the step (``bench_bandwidth.py`` measures that
wait, ``scheduler_critical_ms_per_step``). Each run records both splits: ``on_critical_path`` is the
CPU the step itself spends (0 when run ahead), ``off_critical_path`` the scheduler thread's.

    python benchmarks/bench_home_split.py --world-sizes 8 16 32 64 128 --batches 2048 8192 \
        --settings kaggle --dims 16 128 --out benchmarks/results/home_split.json
    python benchmarks/bench_home_split.py --settings terabyte --batches 2048 8192 --out ...  # 10x rows:
        # ~20 GB of per-row access counts and ids; one dim at a time on a 23 GB machine
    python benchmarks/bench_home_split.py --world-sizes 128 --fill --out benchmarks/results/home_split_fill.json
"""

from __future__ import annotations

import argparse
import gc
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
from torchrec_herald.pipeline.home_split_native import CompiledHomeSplitPlanner  # noqa: E402
from torchrec_herald.planner import AccessStats, CostModelHotSetSelector  # noqa: E402

log = logging.getLogger("bench_home_split")

IMPLS = {"compiled": CompiledHomeSplitPlanner, "python": HomeSplitLazyPlanner}
#: setting -> label in the results (terabyte: 10x Kaggle's rows per table)
LABELS = {"kaggle": "Kaggle rows", "terabyte": "10x Kaggle rows"}


def _wire_bytes(msgs: List[Messages]) -> torch.Tensor:
    """Per sending rank: int64 bytes sent to the other ranks (counts and words)."""
    return torch.tensor([8 * m.wire_words(s) for s, m in enumerate(msgs)], dtype=torch.float64)


class Run:
    """One (impl, dim) planner set over the shared trace of a (setting, W, B)."""

    def __init__(self, impl: str, dim: int, tables: List[Any], stats: AccessStats, W: int, B: int, G: int,
                 a: argparse.Namespace) -> None:
        self.impl, self.dim, self.tables = impl, dim, tables
        self.choice = CostModelHotSetSelector().select(stats, tables, W, B, a.hot_budget)
        self.lam = {t.name: float(stats.lookups_per_step(t.name, G).sum()) for t in tables}
        self.layout = RowLayout.build(W, {t.name: t.num_embeddings for t in tables},
                                      {n: c.hot_ids for n, c in self.choice.items()})
        row_bytes = (dim + 1) * FLOAT
        own_rows = int(self.layout.block_rows[0].sum())
        caps = cache_rows_for_budget(self.layout, int(a.cache_factor * own_rows * row_bytes), row_bytes)
        self.planners = [IMPLS[impl](self.layout, r, window=a.window, capacity_rows=caps) for r in range(W)]
        self.offsets = self.layout.table_offsets.unsqueeze(1)
        self.cpu = torch.zeros(W, dtype=torch.float64)
        self.meta = torch.zeros(W, dtype=torch.float64)
        self.vectors = 0
        self.timed = 0
        self.default = default_plan_bytes(tables, W, B, self.lam, dim)  # TorchRec's default plan, priced once

    def step(self, queue: List[List[torch.Tensor]], record: bool) -> None:
        W = len(self.planners)
        t_stage = torch.zeros(W, dtype=torch.float64)
        msgs = []
        for r, p in enumerate(self.planners):
            t0 = time.perf_counter()
            msgs.append(p.reader_messages(queue))
            t_stage[r] += time.perf_counter() - t0
        replies = []
        for r, (p, m) in enumerate(zip(self.planners, transpose_messages(msgs))):
            t0 = time.perf_counter()
            replies.append(p.home_replies(m))
            t_stage[r] += time.perf_counter() - t0
        plans = []
        for r, (p, m) in enumerate(zip(self.planners, transpose_messages(replies))):
            t0 = time.perf_counter()
            plans.append(p.assemble(m))
            t_stage[r] += time.perf_counter() - t0
        if record:
            self.cpu += t_stage
            self.meta += _wire_bytes(msgs) + _wire_bytes(replies)
            self.vectors += sum(p.counters.vectors for p in plans)
            self.timed += 1

    def reset_timing(self) -> None:
        self.cpu.zero_()
        self.meta.zero_()
        self.vectors = self.timed = 0

    def fill(self) -> float:
        """The least full rank's cache fill (compiled planners)."""
        return min(p.cache_fill() for p in self.planners) if self.impl == "compiled" else float("nan")

    def figures(self, W: int, B: int) -> Dict[str, Any]:
        cpu, meta = self.cpu / self.timed, self.meta / self.timed
        hot_sync = sum(c.expected.herald_hot_sync for c in self.choice.values())
        herald = self.vectors / self.timed * (self.dim * FLOAT + INDEX) + hot_sync
        default = self.default
        saved = (default - herald) / W if default is not None else float("nan")
        state = [p.state_bytes() for p in self.planners]
        return {"impl": self.impl, "dim": self.dim, "steps_timed": self.timed, "hot_rows": self.layout.num_hot,
                "scheduler_cpu_s_per_rank_step": {"mean": float(cpu.mean()), "max": float(cpu.max())},
                "critical_path_s_per_rank_step": {"on_critical_path": 0.0, "off_critical_path_mean": float(cpu.mean()),
                                                  "off_critical_path_max": float(cpu.max())},
                "metadata_bytes_per_rank_step": {"mean": float(meta.mean()), "max": float(meta.max())},
                "state_bytes_per_rank": {"mean": float(np.mean(state)), "max": float(max(state))},
                "cache_fill_min": self.fill(),
                "embedding_bytes_per_step": {"stock_default_plan": default, "herald_by_home": herald},
                "herald_saves_per_rank_step": saved,
                "metadata_share_of_saving": {"mean": float(meta.mean()) / saved, "max": float(meta.max()) / saved}}


def measure(setting: str, W: int, B: int, a: argparse.Namespace) -> List[Dict[str, Any]]:
    """Every (impl, dim) run of one (setting, W, B) on the same trace."""
    K, G = a.window, W * B
    src = SyntheticCriteo(scale=SETTINGS[setting], seed=0)
    names, sizes = src.feature_names, src.num_embeddings
    sample = [kjt_from_ids(names, src.global_batch("train", -1 - i, G)[1][:, :min(G, 65536)])
              for i in range(a.stats_batches)]
    runs = []
    stats = None
    for dim in a.dims:
        tables = build_tables(names, sizes, dim, "SUM")
        if stats is None:  # access counts per row: the same for every dim (one copy: 10x Kaggle has 338M rows)
            stats = AccessStats.from_batches(sample, tables)
        for impl in a.impls:
            if impl == "python" and W not in a.python_at:
                continue
            runs.append(Run(impl, dim, tables, stats, W, B, G, a))
    del stats, sample  # 10x Kaggle: gigabytes of per-row counts, not needed while stepping
    gc.collect()
    offsets = runs[0].offsets
    queue: List[List[torch.Tensor]] = []
    out_extra: Dict[str, Any] = {}
    i, step = 0, 0
    filled_at = None
    while True:
        keys = src.global_batch("train", i, G)[1] + offsets  # [F, G]
        i += 1
        queue.append([torch.from_numpy(np.unique(keys[:, r * B:(r + 1) * B].numpy())) for r in range(W)])
        if len(queue) < K:
            continue
        record = step < a.steps or filled_at is not None  # the cold start, then the full caches
        for run in runs:
            run.step(queue, record)
        queue.pop(0)
        step += 1
        if step == a.steps and not a.fill:
            break
        if a.fill and step >= a.steps:
            fill = min(run.fill() for run in runs if run.impl == "compiled")
            if filled_at is None and (fill >= a.fill_target or step >= a.fill_max_steps):
                filled_at = step
                out_extra = {"cold_start": [run.figures(W, B) for run in runs]}
                for run in runs:
                    run.reset_timing()
                log.info("%s W=%d B=%d: caches %.1f %% full at step %d", setting, W, B, 100 * fill, step)
            elif filled_at is not None and step >= filled_at + a.steps:
                break
    results = []
    for run in runs:
        fig = run.figures(W, B)
        fig.update({"setting": setting, "rows": LABELS[setting], "world_size": W, "local_batch": B, "window": K})
        if a.fill:
            fig["caches_filled_at_step"] = filled_at
            fig["cold_start"] = next(c for c in out_extra["cold_start"] if c["impl"] == run.impl and c["dim"] == run.dim)
        log.info("%s W=%d B=%d dim=%d %s: cpu %.2f ms mean, %.2f max per rank-step; metadata %.1f %% of the saving "
                 "(max %.1f %%); state %.1f MiB (max %.1f); caches %.1f %% full", setting, W, B, run.dim, run.impl,
                 1e3 * fig["scheduler_cpu_s_per_rank_step"]["mean"], 1e3 * fig["scheduler_cpu_s_per_rank_step"]["max"],
                 100 * fig["metadata_share_of_saving"]["mean"], 100 * fig["metadata_share_of_saving"]["max"],
                 fig["state_bytes_per_rank"]["mean"] / 2**20, fig["state_bytes_per_rank"]["max"] / 2**20,
                 100 * fig["cache_fill_min"])
        results.append(fig)
    return results


def plot(runs: List[Dict[str, Any]], scale_json: Path, path: Path) -> None:
    """Scheduler CPU, metadata share and plan state per rank vs W: the compiled planner by home per
    (rows, local batch, dim), the Python reference where measured, and global planning
    (``bench_scale``'s Kaggle rows, when ``scale_json`` exists)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    glob = ([r for r in json.loads(scale_json.read_text())["runs"] if r["setting"] == "kaggle"]
            if scale_json.exists() else [])
    glob.sort(key=lambda r: r["world_size"])
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    groups: Dict[tuple, List[Dict[str, Any]]] = {}
    for r in runs:
        groups.setdefault((r["impl"], r["setting"], r["local_batch"], r["dim"]), []).append(r)
    styles = ["o-", "s-", "^-", "v-", "D-", "P-", "X-", "*-"]
    for k, ((impl, setting, B, dim), rs) in enumerate(sorted(groups.items())):
        rs.sort(key=lambda r: r["world_size"])
        W = [r["world_size"] for r in rs]
        label = f"{impl}: {LABELS[setting]}, B={B}, dim {dim}"
        style = "x:" if impl == "python" else styles[k % len(styles)]
        axes[0].plot(W, [1e3 * r["scheduler_cpu_s_per_rank_step"]["max"] for r in rs], style, label=label)
        axes[1].plot(W, [100 * r["metadata_share_of_saving"]["max"] for r in rs], style, label=label)
        axes[2].plot(W, [r["state_bytes_per_rank"]["max"] / 2**20 for r in rs], style, label=label)
    fill_json = path.with_name("home_split_fill.json")
    if fill_json.exists():  # the --fill run: state and CPU once every cache is full
        for r in json.loads(fill_json.read_text())["runs"]:
            label = f"full caches ({r['caches_filled_at_step']} steps): {LABELS[r['setting']]}, B={r['local_batch']}"
            axes[0].plot([r["world_size"]], [1e3 * r["scheduler_cpu_s_per_rank_step"]["max"]], "kD", mfc="none", ms=9,
                         label=label)
            axes[2].plot([r["world_size"]], [r["state_bytes_per_rank"]["max"] / 2**20], "kD", mfc="none", ms=9,
                         label=label)
    if glob:
        Wg = [r["world_size"] for r in glob]
        axes[0].plot(Wg, [1e3 * r["scheduler_cpu_s_total"] for r in glob], "s--", color="tab:red",
                     label="global planning (bench_scale), B=2048")
        axes[1].plot(Wg, [100 * r["metadata_share_of_saving"] for r in glob], "s--", color="tab:red")
    axes[0].plot([8, 128], [2, 8], "k*", ms=12, label="targets: 2 ms at W=8, 8 ms mean at W=128 (B=2048)")
    axes[0].axhline(25, color="gray", ls=":", label="25 ms target at W=128, B=8192")
    axes[1].axhline(5, color="gray", ls=":", label="5 % target")
    axes[2].axhline(64, color="gray", ls=":", label="64 MiB target")
    titles = ("scheduler CPU per rank and step, max over ranks (one thread)",
              "scheduling metadata / embedding bytes saved (max over ranks)", "plan state per rank (max over ranks)")
    for ax, title, ylabel in zip(axes, titles, ("ms", "%", "MiB")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("ranks W")
        ax.set_ylabel(ylabel)
        ax.set_title(title, fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)
    fig.suptitle("Planning by home on full Criteo cardinalities, window 5")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    log.info("wrote %s", path)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world-sizes", type=int, nargs="+", default=[8, 16, 32, 64, 128])
    p.add_argument("--settings", nargs="+", default=["kaggle"], choices=sorted(SETTINGS))
    p.add_argument("--batches", type=int, nargs="+", default=[2048])
    p.add_argument("--dims", type=int, nargs="+", default=[16])
    p.add_argument("--impls", nargs="+", default=["compiled"], choices=sorted(IMPLS))
    p.add_argument("--python-at", type=int, nargs="*", default=[8, 128],
                   help="world sizes at which the Python reference runs too (with --impls python)")
    p.add_argument("--window", type=int, default=5)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--fill", action="store_true", help="run on until every cache is full; time --steps steps then")
    p.add_argument("--fill-target", type=float, default=0.99)
    p.add_argument("--fill-max-steps", type=int, default=400)
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
    runs: List[Dict[str, Any]] = []
    for setting in a.settings:
        for B in a.batches:
            for W in a.world_sizes:
                runs.extend(measure(setting, W, B, a))
                a.out.write_text(json.dumps({"machine": machine(), "command": "python " + " ".join(sys.argv),
                                             "runs": runs}, indent=2))
    plot(runs, a.scale_json, a.out.with_suffix(".png"))


if __name__ == "__main__":
    main()
