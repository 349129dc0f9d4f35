"""Which of the exact plan's pulls could travel before the step ahead of them ends: of the rows plan t+1
pulls, the share that no rank read at step t (so none was updated there), against those step t updated.

The exact plan's chain after backward is reduce -> update -> push -> the next step's pulls. A pulled row
that step t did not update could be sent while step t trains; a row step t updated has to wait for its
update. Trains 2 ranks on CPU (gloo, loopback) with ``planner=herald pipeline=herald
pipeline.scheduling=on`` and records every plan the executor begins.

    python benchmarks/pull_split.py [--steps 200] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from step_ops import CONFIGS, build_cpu_run  # noqa: E402 (the ops count's configurations)


def worker(rank: int, world: int, steps: int) -> Dict[str, Any]:
    import torch

    import torchrec_herald.sharding.plan_exec as plan_exec

    begun: List[Any] = []
    begin = plan_exec.PlanExecutor.begin

    def recording_begin(self: Any, plan: Any) -> None:
        begun.append(plan)
        begin(self, plan)

    plan_exec.PlanExecutor.begin = recording_begin  # type: ignore[method-assign]
    _, pipeline, it, _ = build_cpu_run(CONFIGS["herald"][1], steps + 10, rank, world)
    for _ in range(steps):
        pipeline.progress(it)
    pipeline.detach()
    pulls = untouched = misses = misses_untouched = 0
    for before, plan in zip(begun, begun[1:]):
        keys = plan.pull[:, 0]
        free = ~torch.isin(keys, before.update_keys)  # no rank read (or updated) the row at the step before
        pulls += keys.numel()
        untouched += int(free.sum())
        misses += int(plan.pull_miss.sum())
        misses_untouched += int((plan.pull_miss & free).sum())
    n = max(len(begun) - 1, 1)
    return {"rank": rank, "steps": len(begun), "pulled_rows_per_step": pulls / n,
            "not_updated_the_step_before": untouched / n, "share_not_updated": untouched / max(pulls, 1),
            "miss_pulls_per_step": misses / n, "miss_pulls_not_updated": misses_untouched / n}


def main(argv: Optional[List[str]] = None) -> None:
    from torchrec_herald.dist_utils import run_multiprocess

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    ranks = run_multiprocess(worker, 2, a.steps, timeout_s=1800)
    r = ranks[0]  # (every rank holds the same global plans)
    print(f"pulled rows per step (all ranks): {r['pulled_rows_per_step']:.1f}; not updated at the step before: "
          f"{r['not_updated_the_step_before']:.1f} ({100 * r['share_not_updated']:.1f} %); miss pulls: "
          f"{r['miss_pulls_per_step']:.1f}, of which not updated at the step before: {r['miss_pulls_not_updated']:.1f}")
    if a.json:
        command = "python benchmarks/pull_split.py " + " ".join(argv if argv is not None else sys.argv[1:])
        Path(a.json).write_text(json.dumps({"command": command.strip(), "ranks": ranks}, indent=1))


if __name__ == "__main__":
    main()
