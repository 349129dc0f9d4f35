"""The input allocator's trade-off inside Herald scheduling: embedding bytes saved vs sample-exchange
bytes spent, for ``pipeline.move_penalty`` ∈ {0, 1, 3}, priced per batch (null: a sample moves only where
its local lookups save more bytes than it sends), ``allocator=auto`` (the default: priced, and samples move
only in batches where one lookup made local pays for a sample) and the identity allocator (W=4 by
default). Per-rank batches (``global_batches=false``), where a move sends the sample; global planning.

    .venv/bin/python benchmarks/allocator_sweep.py [--world-size 4] [--steps 100] [--out J] [overrides ...]

Each row is a real multi-process run of ``planner=herald pipeline=herald`` (lazy cache/plan) on the
default data; writes ``benchmarks/results/allocator_sweep.json`` (``allocator_sweep_w<W>.json`` for another
``--world-size``) and prints a markdown table.
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
GREEDY = ["pipeline.allocator=greedy"]
VARIANTS = {"identity": ["pipeline.allocator=identity"],
            "greedy, move_penalty 0": GREEDY + ["pipeline.move_penalty=0"],
            "greedy, move_penalty 1": GREEDY + ["pipeline.move_penalty=1"],
            "greedy, move_penalty 3": GREEDY + ["pipeline.move_penalty=3"],
            "greedy, priced": GREEDY,
            "auto (default): priced, moves where one lookup pays": []}


def _worker(rank: int, world: int, overrides: List[str], run_dir: str) -> Dict[str, Any]:
    from torchrec_herald.config import compose_config
    from torchrec_herald.trainer import run_training

    return run_training(compose_config(overrides), Path(run_dir), show_progress=False)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world-size", type=int, default=4)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--out", help="the JSON written (default: results/allocator_sweep.json at 4 ranks, "
                                 "results/allocator_sweep_w<W>.json otherwise)")
    p.add_argument("overrides", nargs="*")
    a = p.parse_args()
    rows = []
    for name, ov in VARIANTS.items():
        # a declared slow link: herald's plan trains (on this host's fast loopback the model of time picks stock)
        overrides = ["planner=herald", "pipeline=herald", "planner.link_mbit=200", "pipeline.scheduling=on",
                     "pipeline.global_batches=false", "pipeline.planning=global",
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
                     "move_penalty": m["herald_pipeline"].get("move_penalty"),
                     "samples_per_s": m.get("samples_per_s"),
                     "local_share": m["herald_pipeline"]["local_lookup_share"]})
    (HERE / "results").mkdir(exist_ok=True)
    command = "python benchmarks/allocator_sweep.py " + " ".join(sys.argv[1:])
    out = Path(a.out) if a.out else HERE / "results" / (
        "allocator_sweep.json" if a.world_size == 4 else f"allocator_sweep_w{a.world_size}.json")
    out.write_text(json.dumps({"command": command.strip(), "rows": rows},
                                                                      indent=2))
    print(f"Command: `{command.strip()}` ({a.world_size} ranks, {a.steps} steps)\n")
    print("| allocator | embedding KiB/step | emb. vectors/step | sample exchange KiB | schedule metadata KiB | "
          "total KiB/step | moved samples/step | local lookup share | penalty (priced) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        pen = r["move_penalty"] or {}
        print(f"| {r['variant']} | {r['embedding_kib']:.1f} | {r['embedding_vectors']:.0f} | {r['samples_kib']:.1f} | "
              f"{r['meta_kib']:.1f} | {r['total_kib']:.1f} | {r['moved']:.0f} | "
              f"{format(r['local_share'], '.3f') if r['local_share'] else '—'} | "
              f"{pen.get('priced') if pen.get('set') is None and pen.get('priced') is not None else '—'}"
              f"{' (moves at <= ' + str(pen['max_priced']) + ')' if pen.get('max_priced') is not None else ''} |")


if __name__ == "__main__":
    main()
