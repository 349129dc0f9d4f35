"""How far herald's per-step losses move from stock TABLE_WISE's over a run: the gap each step, the first step
that differs and the largest gap, herald's hot replication against stock on the same batches (2 ranks, the
driver's defaults, the embedding optimizer given).

    python benchmarks/exactness_drift.py [--steps 60] [--batch-size 256] [--optimizer rowwise_adagrad|sgd]
        [--against herald|row_wise|stock] [--out benchmarks/results/exactness_drift.json]

``--against row_wise`` / ``stock`` measure stock TorchRec's own drift between two of its plans (ROW_WISE or its
default plan against TABLE_WISE: another order of the same sums too), the yardstick for herald's.

A hot row's gradient is summed over ranks (per-rank partial sums, where stock's kernel adds every occurrence in
turn): the same arithmetic in another order, so an ulp can differ, and the training's own dynamics decide whether
it grows. Appends one row per call to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any, Dict, List

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))


def _train(rank: int, world: int, overrides: List[str], run_dir: str) -> List[float]:
    from torchrec_herald.config import compose_config
    from torchrec_herald.trainer import run_training

    run_training(compose_config(overrides), Path(run_dir), show_progress=False)
    return json.loads((Path(run_dir) / "losses.json").read_text())


def main() -> None:
    from torchrec_herald.dist_utils import run_multiprocess

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--optimizer", default="rowwise_adagrad")
    ap.add_argument("--against", choices=("herald", "row_wise", "stock"), default="herald",
                    help="the run compared with stock TABLE_WISE: herald's hot replication, or another stock plan")
    ap.add_argument("--out", default=str(HERE / "results" / "exactness_drift.json"))
    a = ap.parse_args()
    common = [f"data.num_train_batches={a.steps}", "eval=false", f"batch_size={a.batch_size}", f"optimizer={a.optimizer}"]
    other = (["planner=herald", "planner.link_mbit=null", "planner.dense_sync=ddp"] if a.against == "herald"
             else [f"planner={a.against}"])
    with tempfile.TemporaryDirectory() as tmp:
        stock = run_multiprocess(_train, 2, common + ["planner=table_wise"], f"{tmp}/stock")[0]
        herald = run_multiprocess(_train, 2, common + other, f"{tmp}/other")[0]
    gaps = [abs(s - h) for s, h in zip(stock, herald)]
    row: Dict[str, Any] = {"against": a.against, "steps": a.steps, "batch_size": a.batch_size, "optimizer": a.optimizer,
                           "first_step_differing": next((i + 1 for i, g in enumerate(gaps) if g), None),
                           "largest_gap": max(gaps), "largest_gap_step": gaps.index(max(gaps)) + 1, "gaps": gaps}
    out = Path(a.out)
    rows = json.loads(out.read_text())["rows"] if out.exists() else []
    out.write_text(json.dumps({"rows": rows + [row]}, indent=1))
    print({k: v for k, v in row.items() if k != "gaps"})


if __name__ == "__main__":
    main()
