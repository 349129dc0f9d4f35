"""Each technique's ratio over the configuration it adds to, run by run: scheduling over hot replication
alone and HET (s=3) over scheduling, from several ``bench_bandwidth.py --configs hot sched het`` runs of
the same code at one link rate: each run's ratio of medians (blue at or over the target, red under), the
target a dashed line, and the ratio of the medians pooled over every run's repeats a dotted one.

    python benchmarks/plot_technique_ratios.py --rate 200 --target 1.1 \
        --out benchmarks/results/technique_ratios_200.png benchmarks/results/bandwidth_w2_techniques_batch_keys*.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Dict, List

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

PAIRS = (("sched", "hot", "scheduling / hot replication alone"), ("het", "sched", "HET s=3 / scheduling"))


def _rows(path: Path, rate: int) -> Dict[str, dict]:
    rows = json.loads(path.read_text())["rows"]
    return {r["config"]: r for r in rows if r["rate_mbit"] == rate and r["world_size"] == 2}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rate", type=int, default=200)
    ap.add_argument("--target", type=float, default=1.1)
    ap.add_argument("--out", required=True)
    ap.add_argument("runs", nargs="+")
    a = ap.parse_args()
    runs = [(Path(p), _rows(Path(p), a.rate)) for p in sorted(a.runs)]
    runs = [(p, r) for p, r in runs if all(c in r for pair in PAIRS for c in pair[:2])]
    if not runs:
        raise SystemExit(f"no run holds hot, sched and het at {a.rate} Mbit/s")
    fig, axes = plt.subplots(1, len(PAIRS), figsize=(5.5 * len(PAIRS), 4), sharey=True)
    for ax, (num, den, title) in zip(axes, PAIRS):
        medians: List[float] = []
        for i, (_, r) in enumerate(runs):
            ratio = r[num]["samples_per_s"] / r[den]["samples_per_s"]
            medians.append(ratio)
            ax.scatter([i + 1], [ratio], s=70, color="tab:blue" if ratio >= a.target else "tab:red", zorder=3)
            ax.annotate(f"{ratio:.2f}", (i + 1, ratio), textcoords="offset points", xytext=(0, 8), ha="center")
        pooled = (statistics.median(x for _, r in runs for x in r[num]["repeat_samples_per_s"])
                  / statistics.median(x for _, r in runs for x in r[den]["repeat_samples_per_s"]))
        ax.axhline(a.target, ls="--", color="k", lw=1, label=f"target {a.target:g}×")
        ax.axhline(pooled, ls=":", color="tab:blue", lw=1, label=f"pooled repeats {pooled:.2f}×")
        ax.axhline(1.0, color="0.8", lw=1)
        met = sum(m >= a.target for m in medians)
        ax.set_title(f"{title}\n{met} of {len(medians)} runs at or over the target")
        ax.set_xlabel("protocol run (5 repeats each)")
        ax.set_xticks(range(1, len(runs) + 1))
        ax.legend(loc="lower right")
    axes[0].set_ylabel(f"samples/s ratio at {a.rate} Mbit/s (medians of 5 repeats)")
    fig.tight_layout()
    fig.savefig(a.out, dpi=110)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
