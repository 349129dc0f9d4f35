"""Herald vs its stock baseline in one ``python -m torchrec_herald.train ... compare_with=<plan>`` run dir:
per-step loss agreement, eval, samples/s and herald's scheduler time, as JSON on stdout.

    python3 scripts/gpu/compare_runs.py outputs/<run id> > herald_vs_stock.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from machine_info import machine  # noqa: E402  (benchmarks/machine_info.py)


def main() -> None:
    run = Path(sys.argv[1])
    base = next(run.glob("baseline_*"))
    h, s = (json.loads((d / "losses.json").read_text()) for d in (run, base))
    hm, sm = (json.loads((d / "metrics.json").read_text()) for d in (run, base))
    ht, st = torch.tensor(h, dtype=torch.float64), torch.tensor(s, dtype=torch.float64)
    n = min(len(h), len(s))
    diff = (ht[:n] - st[:n]).abs()
    out = {
        "run_dir": str(run), "baseline": base.name, "steps": [len(h), len(s)],
        "loss_max_abs_diff": float(diff.max()), "loss_max_rel_diff": float((diff / st[:n].abs().clamp(min=1e-12)).max()),
        "loss_max_rel_diff_first_steps": {str(k): float((diff[:k] / st[:k].abs().clamp(min=1e-12)).max())
                                          for k in (1, 10, 50, 100, n) if k <= n},
        "first_step_rel_diff_over_1e-5": next((i for i, x in enumerate((diff / st[:n].abs()).tolist()) if x > 1e-5),
                                              None),
        "loss_rel_diff_per_step": (diff / st[:n].abs().clamp(min=1e-12)).tolist(),
        "eval": {"herald": hm["eval"], "stock": sm["eval"]},
        "samples_per_s": {"herald": hm["samples_per_s"], "stock": sm["samples_per_s"]},
        "step_time_s": {"herald": hm["step_time_s"], "stock": sm["step_time_s"]},
        "plan": {"herald": sorted(set(hm["plan"].values())), "stock": sorted(set(sm["plan"].values()))},
        "herald_pipeline": hm.get("herald_pipeline", {}),
        "machine": machine(),
    }
    json.dump(out, sys.stdout, indent=2)


if __name__ == "__main__":
    main()
