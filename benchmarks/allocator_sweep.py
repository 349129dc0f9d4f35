"""The input allocator's trade-off inside Herald scheduling: embedding bytes saved vs sample-exchange
bytes spent, for ``pipeline.move_penalty`` ∈ {0, 1, 3} and the identity allocator (W=4 by default).

    .venv/bin/python benchmarks/allocator_sweep.py [--world-size 4] [--steps 100] [overrides ...]

Each row is a real multi-process run of ``planner=herald pipeline=herald`` (lazy cache/plan) on the
default data; writes ``benchmarks/results/allocator_sweep.json`` and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any, Dict, List

from torchrec_herald.dist_utils import run_multiprocess

HERE = Path(__file__).resolve().parent
VARIANTS = {"identity": ["pipeline.allocator=identity"], "greedy, move_penalty 0": ["pipeline.move_penalty=0"],
            "greedy, move_penalty 1": ["pipeline.move_penalty=1"], "greedy, move_penalty 3": ["pipeline.move_penalty=3"]}


def _worker(rank: int, world: int, overrides: List[str], run_dir: str) -> Dict[str, Any]:
    from torchrec_herald.config import compose_config
    from torchrec_herald.trainer import run_training

    return run_training(compose_config(overrides), Path(run_dir), show_progress=False)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world-size", type=int, default=4)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("overrides", nargs="*")
    a = p.parse_args()
    rows = []
    for name, ov in VARIANTS.items():
        overrides = ["planner=herald", "pipeline=herald", "pipeline.scheduling=on", "pipeline.global_batches=false",
                     "pipeline.run_ahead=false", f"data.num_train_batches={a.steps}", "eval=false"] + ov + a.overrides
        with tempfile.TemporaryDirectory() as tmp:
            m = run_multiprocess(_worker, a.world_size, overrides, tmp)[0]
        tags = m["traffic_per_step_by_tag"]
        rows.append({"variant": name, "overrides": overrides,
                     "embedding_kib": m["traffic_per_step_total"]["embedding_vectors"] * m["config"]["model"]["embedding_dim"] * 4 / 1024,
                     "embedding_vectors": m["traffic_per_step_total"]["embedding_vectors"],
                     "total_kib": m["traffic_per_step_total"]["bytes"] / 1024,
                     "samples_kib": tags.get("herald_samples", {}).get("bytes", 0) / 1024,
                     "meta_kib": tags.get("herald_schedule_meta", {}).get("bytes", 0) / 1024,
                     "moved": m["herald_pipeline"]["moved_samples_per_step"],
                     "local_share": m["herald_pipeline"]["local_lookup_share"]})
    (HERE / "results").mkdir(exist_ok=True)
    command = "python benchmarks/allocator_sweep.py " + " ".join(sys.argv[1:])
    (HERE / "results" / "allocator_sweep.json").write_text(json.dumps({"command": command.strip(), "rows": rows},
                                                                      indent=2))
    print(f"Command: `{command.strip()}` ({a.world_size} ranks, {a.steps} steps)\n")
    print("| allocator | embedding KiB/step | emb. vectors/step | sample exchange KiB | schedule metadata KiB | "
          "total KiB/step | moved samples/step | local lookup share |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['variant']} | {r['embedding_kib']:.1f} | {r['embedding_vectors']:.0f} | {r['samples_kib']:.1f} | "
              f"{r['meta_kib']:.1f} | {r['total_kib']:.1f} | {r['moved']:.0f} | "
              f"{'—' if r['variant'] == 'identity' else format(r['local_share'], '.3f')} |")


if __name__ == "__main__":
    main()
