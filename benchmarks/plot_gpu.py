"""benchmarks/results/gpu.png from the GPU results JSON (scripts/gpu/run_checks.sh, benchmarks/scheduler_cost.py):
left, the DLRM step on the H100 next to herald's scheduler CPU time per step at simulated W = 8 and 64;
right, herald (plan mode, CUDA) vs stock TABLE_WISE (CUDA): per-step loss difference, Adagrad and SGD.

    python benchmarks/plot_gpu.py
"""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

R = Path(__file__).resolve().parent / "results"


def main() -> None:
    stock = {r["local_batch"]: r["step_s_median"] * 1e3 for r in json.loads((R / "gpu_step_time.json").read_text())["runs"]}
    herald = {r["local_batch"]: r["step_s_median"] * 1e3
              for r in json.loads((R / "gpu_step_time_herald.json").read_text())["runs"]}
    sched = {(r["world_size"], r["local_batch"]): r for r in json.loads((R / "scheduler_cost.json").read_text())["runs"]}
    fig, (a, b) = plt.subplots(1, 2, figsize=(13, 4.6))
    batches = sorted(stock)
    labels = ["stock GPU step\n(1 rank)", "herald GPU step\n(1 rank, plan mode)", "scheduler CPU\nW = 8", "scheduler CPU\nW = 64"]
    colors = ["#4c72b0", "#55a868", "#dd8452", "#c44e52"]
    width = 0.2
    for i, B in enumerate(batches):
        vals = [stock[B], herald[B], sched[(8, B)]["total_s_per_step"] * 1e3, sched[(64, B)]["total_s_per_step"] * 1e3]
        for j, v in enumerate(vals):
            x = i + (j - 1.5) * width
            a.bar(x, v, width, color=colors[j], label=labels[j] if i == 0 else None)
            ratio = "" if j == 0 else f"\n{v / stock[B]:.1f}×" if v / stock[B] < 100 else f"\n{v / stock[B]:.0f}×"
            a.text(x, v * 1.15, f"{v:.0f}{ratio}" if v >= 10 else f"{v:.1f}{ratio}", ha="center", va="bottom", fontsize=8)
    a.set_yscale("log")
    a.set_ylim(1, 4e4)
    a.set_xticks(range(len(batches)), [f"local batch {B}" for B in batches])
    a.set_ylabel("ms per step (log)")
    a.set_title("Does herald's scheduling fit in the H100 step's shadow? (× = vs stock step)", fontsize=10)
    a.legend(fontsize=8, loc="upper left", ncol=2)
    for name, label, color in [("gpu_train.json", "EXACT_ROWWISE_ADAGRAD", "#c44e52"),
                               ("gpu_train_sgd.json", "EXACT_SGD", "#4c72b0")]:
        d = json.loads((R / name).read_text())
        xs = [max(x, 1e-9) for x in d["loss_rel_diff_per_step"]]
        b.plot(range(len(xs)), xs, label=label, color=color, lw=1)
    b.axhline(1e-5, color="gray", ls="--", lw=1, label="1e-5")
    b.set_yscale("log")
    b.set_xlabel("step (1 CUDA rank, local batch 256, default data)")
    b.set_ylabel("|herald − stock| / |stock|, train loss\n(0 drawn at 1e-9)")
    b.set_title("herald plan mode vs stock TABLE_WISE on the H100, same batches", fontsize=10)
    b.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(R / "gpu.png", dpi=110)
    print("wrote", R / "gpu.png")


if __name__ == "__main__":
    main()
