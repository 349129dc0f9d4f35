"""Per-step loss agreement of herald with stock TABLE_WISE (the exact reference) on the default data.

    .venv/bin/python benchmarks/drift.py [--world-size 2] [--steps 100] [overrides ...]

Trains both on the same global batches from the same weights (eval off) and prints the first steps
whose relative loss difference exceeds 1e-5 and the maximum, e.g. with ``optimizer=sgd`` or
``optimizer.eps=0.001`` to see how row-wise Adagrad's eps amplifies summation-order rounding.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_traffic import _worker  # noqa: E402

from torchrec_herald.dist_utils import run_multiprocess  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("overrides", nargs="*")
    a = p.parse_args()
    common = [f"data.num_train_batches={a.steps}", "eval=false", *a.overrides]
    with tempfile.TemporaryDirectory() as tmp:
        losses = {}
        for planner in ("table_wise", "herald"):
            run_multiprocess(_worker, a.world_size, [f"planner={planner}", *common], f"{tmp}/{planner}")
            losses[planner] = json.loads(Path(f"{tmp}/{planner}/losses.json").read_text())
    rel = [abs(x - y) / abs(x) for x, y in zip(losses["table_wise"], losses["herald"])]
    first = [(i, f"{v:.2e}") for i, v in enumerate(rel) if v > 1e-5][:5]
    sys.stdout.write(json.dumps({"overrides": a.overrides, "steps": len(rel), "max_rel_diff": max(rel),
                                 "max_rel_diff_first_50": max(rel[:50]), "first_steps_over_1e-5": first}) + "\n")


if __name__ == "__main__":
    main()
