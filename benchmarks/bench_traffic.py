"""Embedding traffic, stock TorchRec vs herald, on the default data at 2 and 4 ranks.

    .venv/bin/python benchmarks/bench_traffic.py [--world-sizes 2 4] [--steps 300] [overrides ...]

Configurations, each a real multi-process gloo run of ``torchrec_herald.trainer.run_training`` (the
code behind ``python -m torchrec_herald.train``) from this one process tree, on the same data and the
same global batches (same seed, same local batch size, identical initial weights):
TorchRec's default plan, every table TABLE_WISE, herald's hot-row replication (``planner=herald``), and
Herald scheduling with ``pipeline=herald``: the allocator alone (``pipeline.sync=eager``), the cache/plan
alone (``pipeline.allocator=identity``), and both.
Writes ``benchmarks/results/traffic.json``, ``traffic.png`` and the tables between the markers of
``benchmarks/RESULTS.md``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import re
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any, Dict, List

from torchrec_herald.dist_utils import run_multiprocess
from torchrec_herald.trainer import embedding_bytes_per_step as emb_bytes

logger = logging.getLogger("bench_traffic")
HERE = Path(__file__).resolve().parent
STOCK = {"stock default plan": ["planner=stock"], "stock all TABLE_WISE": ["planner=table_wise"]}
HOT = "herald hot replication"
#: each technique on, per-rank scheduling path (scores all-gathered, samples exchanged): the figures in
#: RESULTS.md's traffic tables; the default global-batch path sends no scheduling bytes (see bench_bandwidth.py)
PER_RANK = ["pipeline.scheduling=on", "pipeline.global_batches=false", "pipeline.run_ahead=false"]
#: herald's plan whatever the link (planner.link_mbit=null: no model of time, which on loopback picks stock TABLE_WISE
#: and would leave these rows stock runs under herald's names)
PLAN = ["planner=herald", "planner.link_mbit=null"]
HERALD = {HOT: PLAN,
          # Herald scheduling (HeraldTrainPipeline, window 5): the allocator alone on herald's eager path,
          # the cache/plan alone, and both
          "herald + allocator": PLAN + ["pipeline=herald", "pipeline.sync=eager"] + PER_RANK,
          "herald + cache/plan": PLAN + ["pipeline=herald", "pipeline.allocator=identity"] + PER_RANK,
          "herald + allocator + cache/plan": PLAN + ["pipeline=herald"] + PER_RANK}
SCHED_LABEL = {"herald hot replication": "(b)", "herald + allocator": "(c)", "herald + cache/plan": "(d′)",
               "herald + allocator + cache/plan": "(d)"}
KINDS = ["all_to_all_single", "reduce_scatter_tensor", "all_gather_into_tensor", "all_reduce"]


def _worker(rank: int, world: int, overrides: List[str], run_dir: str) -> Dict[str, Any]:
    from torchrec_herald.config import compose_config
    from torchrec_herald.trainer import run_training

    metrics = run_training(compose_config(overrides), Path(run_dir), show_progress=rank == 0)
    # the per-step losses (mean over ranks), so that two versions of the code can be compared step by step
    return dict(metrics, losses=json.loads((Path(run_dir) / "losses.json").read_text()))


def run(world_sizes: List[int], steps: int, extra: List[str]) -> List[Dict[str, Any]]:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for world in world_sizes:
            for name, overrides in {**STOCK, **HERALD}.items():
                ov = overrides + [f"data.num_train_batches={steps}"] + extra
                logger.info("running %s at %d ranks: %s", name, world, ov)
                t0 = time.perf_counter()
                m = run_multiprocess(_worker, world, ov, f"{tmp}/{world}-{len(rows)}")[0]
                if name in HERALD and not m.get("herald"):
                    raise RuntimeError(f"{name} at {world} ranks trained {set(m['plan'].values())}, not herald's plan "
                                       f"(its decision: {m.get('link_decision', {}).get('chosen')}); nothing written")
                rows.append({"config": name, "overrides": ov, "world_size": world,
                             "wall_s": time.perf_counter() - t0, "metrics": m})
    return rows


def traffic_table(rows: List[Dict[str, Any]]) -> List[str]:
    head = ("| config | ranks | plan | KiB/step (all ranks) | embedding KiB/step | emb. vectors/step | "
            + " | ".join(f"{k} KiB" for k in KINDS) + " | samples/s | eval AUC | eval logloss |")
    lines = [head, "|" + "---|" * (9 + len(KINDS))]
    for r in rows:
        m = r["metrics"]
        per = m["traffic_per_step"]
        kinds = " | ".join(f"{per.get(k, {}).get('bytes', 0) / 1024:.1f}" for k in KINDS)
        plan = " + ".join(f"{n} {t}" for t, n in sorted(Counter(m["plan"].values()).items()))
        lines.append(f"| {r['config']} | {r['world_size']} | {plan} | "
                     f"{m['traffic_per_step_total']['bytes'] / 1024:.1f} | {emb_bytes(m) / 1024:.1f} | "
                     f"{m['traffic_per_step_total']['embedding_vectors']:.0f} | {kinds} | "
                     f"{m['samples_per_s']:.0f} | {m['eval']['auc']:.4f} | {m['eval']['logloss']:.4f} |")
    return lines


def vectors_by_kind_table(rows: List[Dict[str, Any]]) -> List[str]:
    """Embedding vectors per step by collective kind and by herald's tags."""
    tags = ["herald_pooled", "herald_pooled_grad", "herald_hot_sync", "data_parallel_table_allreduce"]
    lines = ["Embedding vectors per step (all ranks) by collective kind, and by tag:", "",
             "| config | ranks | " + " | ".join(KINDS) + " | " + " | ".join(tags) + " |",
             "|" + "---|" * (2 + len(KINDS) + len(tags))]
    for r in rows:
        m = r["metrics"]
        kinds = " | ".join(f"{m['traffic_per_step'].get(k, {}).get('embedding_vectors', 0):.0f}" for k in KINDS)
        by_tag = " | ".join(f"{m['traffic_per_step_by_tag'].get(t, {}).get('embedding_vectors', 0):.0f}" for t in tags)
        lines.append(f"| {r['config']} | {r['world_size']} | {kinds} | {by_tag} |")
    return lines


def herald_tables(rows: List[Dict[str, Any]]) -> List[str]:
    """Reduction vs the cheaper stock configuration, samples/s ratio, AUC, and the cost model's
    prediction vs the measured bytes (per table, at the largest world size)."""
    lines = ["| ranks | herald embedding KiB/step | cheaper stock (its KiB) | reduction vs cheaper stock | "
             "reduction vs all TABLE_WISE | total KiB/step herald / cheaper stock | samples/s ratio | "
             "AUC herald / stock | predicted / measured herald KiB | worst table error |",
             "|" + "---|" * 10]
    for world in sorted({r["world_size"] for r in rows}):
        at = {r["config"]: r["metrics"] for r in rows if r["world_size"] == world}
        h = at.get(HOT)
        if h is None:
            continue
        stock = {name: at[name] for name in STOCK if name in at}
        cheaper = min(stock, key=lambda n: emb_bytes(stock[n]))
        c, tw = stock[cheaper], stock.get("stock all TABLE_WISE", stock[cheaper])
        hr = h["herald"]
        worst = max(abs(hr["measured_bytes_per_step"][t] - p) / max(hr["measured_bytes_per_step"][t], 1.0)
                    for t, p in hr["predicted_bytes_per_step"].items())
        lines.append(
            f"| {world} | {emb_bytes(h) / 1024:.1f} | {cheaper} ({emb_bytes(c) / 1024:.1f}) | "
            f"{100 * (1 - emb_bytes(h) / emb_bytes(c)):.1f} % | {100 * (1 - emb_bytes(h) / emb_bytes(tw)):.1f} % | "
            f"{h['traffic_per_step_total']['bytes'] / 1024:.1f} / {c['traffic_per_step_total']['bytes'] / 1024:.1f} | "
            f"{h['samples_per_s'] / c['samples_per_s']:.2f} | {h['eval']['auc']:.4f} / {c['eval']['auc']:.4f} | "
            f"{hr['predicted_total'] / 1024:.1f} / {hr['measured_total'] / 1024:.1f} | {100 * worst:.1f} % |")
    return lines


def per_table(rows: List[Dict[str, Any]]) -> List[str]:
    h = [r for r in rows if r["config"] == HOT][-1]
    hr = h["metrics"]["herald"]
    lines = [f"Per table at {h['world_size']} ranks (bytes per step, all ranks):", "",
             "| table | hot rows | sync | predicted | measured | error |", "|---|---|---|---|---|---|"]
    for t, p in hr["predicted_bytes_per_step"].items():
        meas = hr["measured_bytes_per_step"][t]
        lines.append(f"| {t} | {hr['hot_rows'][t]} | {hr['sync'][t]} | {p:.0f} | {meas:.0f} | "
                     f"{100 * (p - meas) / max(meas, 1.0):+.1f} % |")
    return lines


def scheduling_table(rows: List[Dict[str, Any]]) -> List[str]:
    """Herald scheduling columns (a)–(d) per world size: bytes, vectors, reduction vs (a) = the cheaper
    stock configuration, samples/s ratio, AUC, and the scheduler's counters and time."""
    lines = ["| ranks | config | KiB/step | embedding KiB/step | emb. vectors/step | embedding bytes vs (a) | "
             "samples/s vs (a) | eval AUC | sample exchange KiB | schedule metadata KiB | pulls (miss/update) | "
             "pushes (update/miss) | reduce | hit rate | moved samples | local lookup share | "
             "scheduler ms (compute) / share of step |",
             "|" + "---|" * 17]
    for world in sorted({r["world_size"] for r in rows}):
        at = {r["config"]: r["metrics"] for r in rows if r["world_size"] == world}
        stock = {name: at[name] for name in STOCK if name in at}
        if not stock:
            continue
        cheaper = min(stock, key=lambda n: emb_bytes(stock[n]))
        a = stock[cheaper]
        for name in [cheaper] + [n for n in HERALD if n in at]:
            m = at[name]
            label = "(a) " + cheaper if name == cheaper else f"{SCHED_LABEL[name]} {name}"
            tags = m["traffic_per_step_by_tag"]
            hp = m.get("herald_pipeline") or {}
            lazy = hp.get("sync") == "lazy"
            cells = [
                f"{m['traffic_per_step_total']['bytes'] / 1024:.1f}", f"{emb_bytes(m) / 1024:.1f}",
                f"{m['traffic_per_step_total']['embedding_vectors']:.0f}",
                "—" if name == cheaper else f"{100 * (emb_bytes(m) / emb_bytes(a) - 1):+.1f} %",
                "1.00" if name == cheaper else f"{m['samples_per_s'] / a['samples_per_s']:.2f}",
                f"{m['eval']['auc']:.4f}",
                f"{tags.get('herald_samples', {}).get('bytes', 0) / 1024:.1f}",
                f"{tags.get('herald_schedule_meta', {}).get('bytes', 0) / 1024:.1f}",
                f"{hp['miss_pull']:.0f} / {hp['update_pull']:.0f}" if lazy else "—",
                f"{hp['update_push']:.0f} / {hp['miss_push']:.0f}" if lazy else "—",
                f"{hp['reduce']:.0f}" if lazy else "—",
                f"{hp['hit_rate']:.3f}" if lazy else "—",
                f"{hp['moved_samples_per_step']:.0f}" if hp else "—",
                f"{hp['local_lookup_share']:.3f}" if hp and hp.get("allocator") == "greedy" else "—",
                (f"{hp['scheduler_ms_per_step']:.1f} ({hp['scheduler_compute_ms_per_step']:.1f}) / "
                 f"{100 * hp['scheduler_share_of_step']:.0f} % ({100 * hp['scheduler_compute_share_of_step']:.0f} %)")
                if hp else "—",
            ]
            lines.append(f"| {world} | {label} | " + " | ".join(cells) + " |")
    return lines


def markdown(rows: List[Dict[str, Any]], command: str) -> Dict[str, str]:
    cfg = rows[0]["metrics"]["config"]
    note = (f"Data: synthetic Criteo-calibrated (scale {cfg['data']['scale']}, zipf_alpha "
            f"{cfg['data']['zipf_alpha']}, seed {cfg['data']['seed']}), local batch {cfg['batch_size']}, "
            f"{rows[0]['metrics']['steps']} steps, dim {cfg['model']['embedding_dim']}, "
            f"{cfg['optimizer']['name']}. KiB/step = bytes all ranks send to other ranks per step "
            f"(TrafficMeter formulas, every collective incl. ids, metadata and DDP); embedding KiB = "
            f"embedding vectors × dim × 4 B (pooled vectors, their gradients, hot-row and DATA_PARALLEL "
            f"gradient rows); all_reduce = DDP dense grads (+ DATA_PARALLEL tables, + herald dense hot "
            f"sync). Machine: {platform.machine()}, {os.cpu_count()} cores, one torch thread per rank, gloo.")
    return {
        "STOCK": "\n".join([f"Command: `{command}`", ""] + traffic_table(rows) + ["", note, ""]
                            + vectors_by_kind_table(rows)),
        "HERALD": "\n".join([f"Command: `{command}` (same runs as the table above)", ""] + herald_tables(rows)
                            + [""] + per_table(rows)),
        "SCHEDULING": "\n".join([f"Command: `{command}` (same runs as the tables above)", ""] + scheduling_table(rows)),
    }


def write_results_md(sections: Dict[str, str]) -> None:
    path = HERE / "RESULTS.md"
    text = path.read_text() if path.exists() else "# Benchmark results\n"
    for name, body in sections.items():
        block = f"<!-- {name}:BEGIN -->\n{body}\n<!-- {name}:END -->"
        pattern = rf"<!-- {name}:BEGIN -->.*<!-- {name}:END -->"
        if re.search(pattern, text, flags=re.S):
            text = re.sub(pattern, lambda _: block, text, flags=re.S)
        else:
            text += f"\n{block}\n"
    path.write_text(text)


#: short labels of the configurations (y axis of traffic.png)
SHORT = {"stock default plan": "stock, default plan", "stock all TABLE_WISE": "stock, all TABLE_WISE",
         HOT: "herald: hot replication", "herald + allocator": "herald: + allocator",
         "herald + cache/plan": "herald: + caches/plan", "herald + allocator + cache/plan": "herald: full"}
#: traffic parts of traffic.png, in stacking order, and their colours
PARTS = {"embedding vectors": "#4c72b0", "ids and lengths": "#9db4d8", "scheduling": "#dd8452",
         "dense all-reduce": "#d9d9d9"}


def plot(rows: List[Dict[str, Any]], out: Path) -> None:
    """One panel per world size, one horizontal bar per configuration: embedding vectors, ids and
    lengths, herald's scheduling bytes and (last, grey) the dense all-reduce, KiB per step on all ranks."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from torchrec_herald.report import traffic_groups

    worlds = sorted({r["world_size"] for r in rows})
    fig, axes = plt.subplots(1, len(worlds), figsize=(6.2 * len(worlds), 3.6), squeeze=False)
    for ax, w in zip(axes[0], worlds):
        at = [r for r in rows if r["world_size"] == w]
        ys = list(range(len(at)))[::-1]
        for y, r in zip(ys, at):
            g = traffic_groups(r["metrics"])
            left = 0.0
            for part, color in PARTS.items():
                v = g[part] / 1024
                ax.barh(y, v, left=left, color=color, label=part if y == ys[0] else None)
                left += v
            emb = g["embedding vectors"] / 1024
            ax.text(0, y, f" {emb:.0f}", va="center", ha="left", fontsize=7, color="white")
        ax.set_yticks(ys, [SHORT.get(r["config"], r["config"]) for r in at], fontsize=8)
        ax.set_xlabel("KiB per step, all ranks (number: embedding vectors)")
        ax.set_title(f"{w} ranks", fontsize=10)
    axes[0][0].legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--no-results-md", action="store_true", help="only write the JSON")
    p.add_argument("--from-json", action="store_true",
                   help="re-render RESULTS.md from benchmarks/results/traffic.json without running")
    p.add_argument("overrides", nargs="*", help="extra Hydra overrides for every run")
    a = p.parse_args()
    out = HERE / "results"
    out.mkdir(exist_ok=True)
    if a.from_json:
        saved = json.loads((out / "traffic.json").read_text())
        rows, command = saved["rows"], saved["command"]
    else:
        rows = run(a.world_sizes, a.steps, a.overrides)
        command = "make bench" if sys.argv[1:] == [] else "python benchmarks/bench_traffic.py " + " ".join(sys.argv[1:])
    sections = markdown(rows, command)  # (before anything is written: a table that cannot be made replaces nothing)
    if not a.from_json:
        (out / "traffic.json").write_text(json.dumps({"command": command, "rows": rows}, indent=2))
    plot(rows, out / "traffic.png")
    if not a.no_results_md:
        write_results_md(sections)
    sys.stdout.write("\n\n".join(sections.values()) + "\n")


if __name__ == "__main__":
    main()
