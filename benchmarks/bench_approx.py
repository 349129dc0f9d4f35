"""Opt-in approximate modes vs herald's exact mode: HET bounded staleness s ∈ {0, 1, 3, 10} and Slipstream
stale-update skipping (input / row granularity), on the default data and on a less skewed setting.

    .venv/bin/python benchmarks/bench_approx.py [--world-size 4] [--steps 300] [overrides ...]

Every row is a real multi-process run of ``planner=herald pipeline=herald`` (HeraldTrainPipeline, exact
lazy plan unless a mode says otherwise) on the same global batches from the same initial weights; the
exact run of each data setting is the reference of its approximate rows (``pipeline.reference=false``
here only avoids training that identical reference again for every row; the driver's default records it
inside each run). Row skipping is also measured on herald's eager path, where it cuts the hot-row
all-reduce. Writes ``benchmarks/results/approx.json`` and the table between the APPROX markers of
``benchmarks/RESULTS.md``.
"""

from __future__ import annotations

import argparse
import json
import logging
import shlex
import sys
import tempfile
from pathlib import Path
from typing import Any, Dict, List

from torchrec_herald.dist_utils import run_multiprocess

HERE = Path(__file__).resolve().parent
logger = logging.getLogger("bench_approx")
DATA = {"default data (zipf 1.22)": [], "less skewed (zipf 1.05)": ["data.zipf_alpha=1.05"]}
MODES = {
    "exact": [],
    "staleness s=0": ["pipeline.staleness=0"],
    "staleness s=1": ["pipeline.staleness=1"],
    "staleness s=3": ["pipeline.staleness=3"],
    "staleness s=10": ["pipeline.staleness=10"],
    "skip input": ["pipeline.skip=input"],
    "skip row": ["pipeline.skip=row"],
    "eager exact": ["pipeline.sync=eager"],
    "eager + skip row": ["pipeline.sync=eager", "pipeline.skip=row"],
}
REFERENCE = {"eager + skip row": "eager exact"}  # default reference: "exact"


def _worker(rank: int, world: int, overrides: List[str], run_dir: str) -> Dict[str, Any]:
    from torchrec_herald.config import compose_config
    from torchrec_herald.trainer import run_training

    return run_training(compose_config(overrides), Path(run_dir), show_progress=False)


def _thresholds(ap: Dict[str, Any]) -> str:
    h = ap.get("skip_thresholds") or []
    if not h:
        return "—"
    return f"{sum(x[1] for x in h) / len(h):.3g} / {sum(x[2] for x in h) / len(h):.3f}"


def table(rows: List[Dict[str, Any]]) -> List[str]:
    from torchrec_herald.trainer import embedding_bytes_per_step

    # samples/s: the data's samples read per second (input skipping that refills its batches reads more than it trains)
    lines = ["| data | mode | KiB/step | embedding KiB/step | hot sync + reduce KiB/step | samples/s vs exact | "
             "AUC | ΔAUC vs exact | Δlogloss vs exact | stale reads | max staleness | row reads not updated | "
             "skip threshold T / sampled share (mean) |",
             "|" + "---|" * 13]
    by = {(r["data"], r["mode"]): r["metrics"] for r in rows}
    for r in rows:
        m, ref = r["metrics"], by[(r["data"], REFERENCE.get(r["mode"], "exact"))]
        ap = m.get("approximate") or {}
        tags = m["traffic_per_step_by_tag"]
        sync = sum(tags.get(t, {}).get("bytes", 0) for t in ("herald_hot_sync", "herald_reduce")) / 1024
        exact = r["mode"] in ("exact", "eager exact")
        lines.append(
            f"| {r['data']} | {r['mode']} | {m['traffic_per_step_total']['bytes'] / 1024:.1f} | "
            f"{embedding_bytes_per_step(m) / 1024:.1f} | {sync:.1f} | "
            f"{'1.00' if exact else format(ap.get('data_samples_per_s', m['samples_per_s']) / ref['samples_per_s'], '.2f')} | "
            f"{m['eval']['auc']:.4f} | {'—' if exact else format(m['eval']['auc'] - ref['eval']['auc'], '+.4f')} | "
            f"{'—' if exact else format(m['eval']['logloss'] - ref['eval']['logloss'], '+.4f')} | "
            f"{'—' if not ap else format(ap['stale_read_share'], '.1%')} | {ap.get('max_staleness', '—')} | "
            f"{'—' if not ap else format(ap['skipped_update_share'], '.1%')} | {_thresholds(ap)} |")
    return lines


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world-size", type=int, default=4)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES), help="the modes to run")
    p.add_argument("--data", nargs="+", choices=list(DATA), default=list(DATA), help="the data settings to run")
    p.add_argument("--name", default="approx",
                   help="results/<name>.json and the RESULTS.md section <NAME> (default: approx, APPROX)")
    p.add_argument("--from-json", action="store_true", help="re-render RESULTS.md from results/<name>.json")
    p.add_argument("overrides", nargs="*")
    a = p.parse_args()
    out = HERE / "results"
    out.mkdir(exist_ok=True)
    if a.from_json:
        saved = json.loads((out / f"{a.name}.json").read_text())
        rows, command = saved["rows"], saved["command"]
    else:
        rows = []
        for data in a.data:
            for mode in a.modes:
                dov, mov = DATA[data], MODES[mode]
                ov = (["planner=herald", "pipeline=herald", "pipeline.reference=false", "pipeline.scheduling=on",
                       f"data.num_train_batches={a.steps}"] + dov + mov + a.overrides)
                logger.info("%s / %s: %s", data, mode, ov)
                with tempfile.TemporaryDirectory() as tmp:
                    m = run_multiprocess(_worker, a.world_size, ov, tmp)[0]
                rows.append({"data": data, "mode": mode, "overrides": ov, "world_size": a.world_size, "metrics": m})
        command = "python benchmarks/bench_approx.py " + shlex.join(sys.argv[1:])  # quoted: copy-pastable
        (out / f"{a.name}.json").write_text(json.dumps({"command": command.strip(), "rows": rows}, indent=2))
    body = "\n".join([f"Command: `{command.strip()}` ({rows[0]['world_size']} ranks, "
                      f"{rows[0]['metrics']['steps']} steps)", ""] + table(rows))
    from bench_traffic import write_results_md

    write_results_md({a.name.upper(): body})
    sys.stdout.write(body + "\n")


if __name__ == "__main__":
    main()
