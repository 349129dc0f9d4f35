"""Stock TorchRec baselines on the default data: TorchRec's default plan vs every table TABLE_WISE.

    .venv/bin/python benchmarks/bench_stock.py [--world-sizes 2 4] [--steps 300] [overrides ...]

Each configuration is a real multi-process gloo run of ``torchrec_herald.trainer.run_training`` (the
code behind ``python -m torchrec_herald.train``), launched from this one process tree, on the same
data (same seed, same local batch size). Writes ``benchmarks/results/stock.json``, a plot, and the
stock table between the STOCK markers of ``benchmarks/RESULTS.md``.
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

import torch

from torchrec_herald.dist_utils import run_multiprocess

logger = logging.getLogger("bench_stock")
HERE = Path(__file__).resolve().parent
CONFIGS = {"stock default plan": ["planner=stock"], "stock all TABLE_WISE": ["planner=table_wise"]}
KINDS = ["all_to_all_single", "reduce_scatter_tensor", "all_gather_into_tensor", "all_reduce"]


def _worker(rank: int, world: int, overrides: List[str], run_dir: str) -> Dict[str, Any]:
    from torchrec_herald.config import compose_config
    from torchrec_herald.trainer import run_training

    return run_training(compose_config(overrides), Path(run_dir), show_progress=rank == 0)


def run(world_sizes: List[int], steps: int, extra: List[str]) -> List[Dict[str, Any]]:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for world in world_sizes:
            for name, overrides in CONFIGS.items():
                ov = overrides + [f"data.num_train_batches={steps}"] + extra
                logger.info("running %s at %d ranks: %s", name, world, ov)
                t0 = time.perf_counter()
                m = run_multiprocess(_worker, world, ov, f"{tmp}/{world}-{len(rows)}")[0]
                rows.append({"config": name, "overrides": ov, "world_size": world,
                             "wall_s": time.perf_counter() - t0, "metrics": m})
    return rows


def markdown(rows: List[Dict[str, Any]], command: str) -> str:
    head = ("| config | ranks | plan | KiB/step (all ranks) | embedding KiB/step | emb. vectors/step | "
            + " | ".join(f"{k} KiB" for k in KINDS) + " | samples/s | eval AUC | eval logloss |")
    lines = [f"Command: `{command}`", "", head, "|" + "---|" * (9 + len(KINDS))]
    for r in rows:
        m = r["metrics"]
        per = m["traffic_per_step"]
        kinds = " | ".join(f"{per.get(k, {}).get('bytes', 0) / 1024:.1f}" for k in KINDS)
        plan = " + ".join(f"{n} {t}" for t, n in sorted(Counter(m["plan"].values()).items()))
        vectors = m["traffic_per_step_total"]["embedding_vectors"]
        emb_kib = vectors * m["config"]["model"]["embedding_dim"] * 4 / 1024
        lines.append(f"| {r['config']} | {r['world_size']} | {plan} | "
                     f"{m['traffic_per_step_total']['bytes'] / 1024:.1f} | {emb_kib:.1f} | {vectors:.0f} | {kinds} | "
                     f"{m['samples_per_s']:.0f} | {m['eval']['auc']:.4f} | {m['eval']['logloss']:.4f} |")
    cfg = rows[0]["metrics"]["config"]
    lines += ["", f"Data: synthetic Criteo-calibrated (scale {cfg['data']['scale']}, zipf_alpha "
                  f"{cfg['data']['zipf_alpha']}, seed {cfg['data']['seed']}), local batch {cfg['batch_size']}, "
                  f"{rows[0]['metrics']['steps']} steps, dim {cfg['model']['embedding_dim']}, "
                  f"{cfg['optimizer']['name']}. KiB/step = bytes all ranks send to other ranks per step "
                  f"(TrafficMeter formulas); embedding KiB = embedding vectors (pooled outputs, their gradients, "
                  f"DATA_PARALLEL table gradient rows) × dim × 4 B; all_reduce = DDP dense grads + DATA_PARALLEL "
                  f"tables. "
                  f"Machine: {platform.machine()}, {os.cpu_count()} cores, one torch thread per rank, gloo."]
    return "\n".join(lines)


def write_results_md(section: str) -> None:
    path = HERE / "RESULTS.md"
    text = path.read_text() if path.exists() else "# Benchmark results\n"
    block = f"<!-- STOCK:BEGIN -->\n{section}\n<!-- STOCK:END -->"
    if "<!-- STOCK:BEGIN -->" in text:
        text = re.sub(r"<!-- STOCK:BEGIN -->.*<!-- STOCK:END -->", lambda _: block, text, flags=re.S)
    else:
        text += f"\n## Stock TorchRec baselines\n\n{block}\n"
    path.write_text(text)


def plot(rows: List[Dict[str, Any]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3.5))
    labels = [f"{r['config']}\n{r['world_size']} ranks" for r in rows]
    bottom = [0.0] * len(rows)
    for k in KINDS:
        vals = [r["metrics"]["traffic_per_step"].get(k, {}).get("bytes", 0) / 1024 for r in rows]
        ax.bar(labels, vals, bottom=bottom, label=k)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_ylabel("KiB per step, all ranks")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--no-results-md", action="store_true", help="only write the JSON")
    p.add_argument("overrides", nargs="*", help="extra Hydra overrides for every run")
    a = p.parse_args()
    rows = run(a.world_sizes, a.steps, a.overrides)
    out = HERE / "results"
    out.mkdir(exist_ok=True)
    (out / "stock.json").write_text(json.dumps(rows, indent=2))
    plot(rows, out / "stock_traffic.png")
    command = "make bench" if sys.argv[1:] == [] else "python benchmarks/bench_stock.py " + " ".join(sys.argv[1:])
    section = markdown(rows, command)
    if not a.no_results_md:
        write_results_md(section)
    sys.stdout.write(section + "\n")


if __name__ == "__main__":
    main()
