"""Planning cost at full Criteo Kaggle size: ``AccessStats.from_batches`` and ``HeraldPlanner.plan``.

The trainer's herald planning path (``trainer.build_plan``) on the default synthetic data at ``--scale``
(1.0: the Kaggle cardinalities, 33.8 M rows): ``--batches`` global batches of ``--batch`` samples are
counted by ``AccessStats.from_batches``, then ``HeraldPlanner`` (``Topology(world_size=W, compute_device="cpu")``,
local batch ``batch / W``, the default cost model and hot-memory budget) plans the DLRM of dim ``--dim``
built on the meta device, with ``HeraldEmbeddingBagCollectionSharder``, no process group.

Each part runs ``--repeats`` times in a fresh process that first loads its inputs (the batches, or the
stats) from disk: the figures are the median seconds (generating the batches is not timed) and the
process's peak RSS while the timed calls ran (VmHWM, the high-water mark ``ru_maxrss`` reports, reset
through ``/proc/self/clear_refs`` once the inputs are loaded), also net of the RSS at that point. ``--threads`` sets
torch's intra-op threads (default: torch's own; the trainer's ranks run with 1); the load average at the
start and end of each part is recorded, since another process on the machine distorts multi-threaded times.
``--baseline REV`` measures the ``torchrec_herald`` package of git revision ``REV`` the same way (same script, same inputs,
the old package first on ``PYTHONPATH``) and checks that both give the same stats counts and the same
plan (hot rows, sync modes, row-wise layout; the expected-traffic floats are compared to rounding).

    python benchmarks/planner_speed.py --scale 1.0 --world-size 8 --dim 128 --batches 20 --batch 65536 --baseline 5aeaf85 --threads 1 2 --out benchmarks/results/planner_speed.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import resource
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
from machine_info import machine  # noqa: E402  (benchmarks/machine_info.py)

log = logging.getLogger("planner_speed")
MODULE = "model.sparse_arch.embedding_bag_collection"


def _rss_mb() -> float:
    """Current resident set size (MiB), from /proc/self/statm."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _peak_rss_mb() -> float:
    """Peak resident set size of this process (MiB): the high-water mark VmHWM of /proc/self/status, else
    ru_maxrss (KiB on Linux; it also keeps the VmHWM a thread saw when it exited, so a reset cannot lower it)."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024
    except (OSError, StopIteration):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _reset_peak_rss() -> bool:
    """Restart the peak RSS from the current RSS (Linux: ``5`` to /proc/self/clear_refs resets VmHWM);
    False where that is not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _timed(repeats: int, call: Any) -> Dict[str, Any]:
    """Median seconds of ``call()`` and the peak RSS while it ran (see the module docstring)."""
    rss_inputs, peak_loading = _rss_mb(), _peak_rss_mb()
    reset = _reset_peak_rss()
    seconds = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        call()
        seconds.append(time.perf_counter() - t0)
    peak = _peak_rss_mb()
    return {"seconds": seconds, "median_s": statistics.median(seconds), "peak_rss_mb": peak,
            "rss_inputs_mb": rss_inputs, "peak_rss_above_inputs_mb": peak - rss_inputs, "peak_rss_was_reset": reset,
            "peak_rss_while_loading_inputs_mb": peak_loading}


def _tables(a: argparse.Namespace, names: List[str], rows: List[int]) -> List[Any]:
    from torchrec_herald.model import build_tables

    return build_tables(names, rows, a.dim, "SUM")


def generate(a: argparse.Namespace, work: Path) -> None:
    """The sampled batches, as the trainer takes them (rank 0 of 1, global batch), saved to ``work``."""
    from torchrec_herald.data import SyntheticCriteo

    data = SyntheticCriteo(scale=a.scale, seed=0)
    kjts = [b.sparse_features for _, b in zip(range(a.batches), data.train_batches(0, 1, a.batch))]
    torch.save({"keys": kjts[0].keys(), "values": [k.values() for k in kjts], "lengths": [k.lengths() for k in kjts],
                "feature_names": data.feature_names, "num_embeddings": data.num_embeddings,
                "num_dense": data.num_dense}, work / "batches.pt")
    log.info("%d batches of %d samples, %d tables, %d rows", a.batches, a.batch, len(data.num_embeddings),
             sum(data.num_embeddings))


def child_stats(a: argparse.Namespace, work: Path, tag: str) -> Dict[str, Any]:
    """Time ``AccessStats.from_batches`` on the saved batches; save the stats for :func:`child_plan`."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    import torchrec_herald
    from torchrec_herald.planner import AccessStats

    load = os.getloadavg()[0]
    d = torch.load(work / "batches.pt")
    kjts = [KeyedJaggedTensor.from_lengths_sync(d["keys"], v, ln) for v, ln in zip(d["values"], d["lengths"])]
    tables = _tables(a, d["feature_names"], d["num_embeddings"])
    del d
    out: Dict[str, AccessStats] = {}

    def call() -> None:
        out.clear()  # the previous repeat's counters are freed first
        out["stats"] = AccessStats.from_batches(kjts, tables)

    timing = _timed(a.repeats, call)
    stats = out["stats"]
    stats.save(work / f"stats_{tag}.pt")
    h = hashlib.sha256()
    for name in ("counts", "sample_counts", "presence"):
        for t in stats.tables:
            h.update(getattr(stats, name)[t].numpy().tobytes())
    return {"code": str(Path(torchrec_herald.__file__).parent), "threads": torch.get_num_threads(),
            "loadavg_1min_start_end": [load, os.getloadavg()[0]], **timing, "num_samples": stats.num_samples,
            "counters_sha256": h.hexdigest()}


def child_plan(a: argparse.Namespace, work: Path, tag: str) -> Dict[str, Any]:
    """Time ``HeraldPlanner(...).plan(model, sharders)`` with the stats :func:`child_stats` saved."""
    from torchrec.distributed.planner import Topology

    import torchrec_herald
    from torchrec_herald.model import build_dlrm_train
    from torchrec_herald.planner import AccessStats, HeraldPlanner
    from torchrec_herald.sharding import HeraldEmbeddingBagCollectionSharder

    load = os.getloadavg()[0]
    d = torch.load(work / "batches.pt")
    tables = _tables(a, d["feature_names"], d["num_embeddings"])
    num_dense = d["num_dense"]
    del d
    model = build_dlrm_train(tables, num_dense, [512, 256, a.dim], [512, 256, 1], device="meta")
    stats = AccessStats.load(work / f"stats_{tag}.pt")
    local_batch = a.batch // a.world_size
    out: Dict[str, Any] = {}

    def call() -> None:
        out.clear()
        planner = HeraldPlanner(topology=Topology(world_size=a.world_size, compute_device="cpu"),
                                batch_size=local_batch, access_stats=stats)
        out["plan"] = planner.plan(model, [HeraldEmbeddingBagCollectionSharder()])

    timing = _timed(a.repeats, call)
    plan = out["plan"]
    h = hashlib.sha256()
    expected: Dict[str, Dict[str, float]] = {}
    for name, ps in plan.plan[MODULE].items():  # type: ignore[union-attr]
        h.update(f"{name}|{ps.sharding_type}|{ps.compute_kernel}|{ps.ranks}|{ps.sharding_spec}|{ps.hot.sync}|".encode())
        h.update(ps.hot.hot_ids.numpy().tobytes())
        expected[name] = dict(ps.hot.expected)
    return {"code": str(Path(torchrec_herald.__file__).parent), "threads": torch.get_num_threads(),
            "loadavg_1min_start_end": [load, os.getloadavg()[0]], "local_batch": local_batch, **timing,
            "hot_rows": sum(int(ps.hot.hot_ids.numel()) for ps in plan.plan[MODULE].values()),  # type: ignore
            "plan_sha256": h.hexdigest(), "expected": expected}


def run_child(a: argparse.Namespace, part: str, work: Path, tag: str, code: Optional[Path],
              threads: Optional[int]) -> Dict[str, Any]:
    """Run ``part`` in a fresh interpreter (``code``: a package tree put first on PYTHONPATH; ``threads``:
    torch's intra-op threads, None for its default)."""
    env = dict(os.environ)
    if code is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(code)] + [p for p in [env.get("PYTHONPATH")] if p])
    out = work / f"{part}_{tag}.json"
    cmd = [sys.executable, __file__, "--child", part, "--work", str(work), "--tag", tag, "--child-out", str(out),
           *(f"--{k.replace('_', '-')}={v}" for k, v in vars(a).items() if k in CONFIG),
           *([f"--threads={threads}"] if threads else [])]
    subprocess.run(cmd, check=True, env=env)
    res = json.loads(out.read_text())
    log.info("%s %s, %d threads: median %.3f s %s, peak RSS %.0f MiB (%.0f above inputs), load %s", tag, part,
             res["threads"], res["median_s"], [round(s, 3) for s in res["seconds"]], res["peak_rss_mb"],
             res["peak_rss_above_inputs_mb"], res["loadavg_1min_start_end"])
    return res


def checkout(rev: str, dest: Path) -> Path:
    """The ``torchrec_herald`` package of git revision ``rev`` under ``dest``."""
    archive = dest / "baseline.tar"
    with open(archive, "wb") as f:
        subprocess.run(["git", "-C", str(REPO), "archive", rev, "torchrec_herald"], check=True, stdout=f)
    with tarfile.open(archive) as tar:
        tar.extractall(dest / "baseline")
    return dest / "baseline"


def max_rel_diff(x: Dict[str, Dict[str, float]], y: Dict[str, Dict[str, float]]) -> float:
    """Largest relative difference between two plans' expected-traffic figures."""
    worst = 0.0
    for t in x:
        for k, u in x[t].items():
            v = y[t][k]
            if u != v:
                worst = max(worst, abs(u - v) / max(abs(u), abs(v)))
    return worst


CONFIG = ("scale", "world_size", "dim", "batches", "batch", "repeats")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scale", type=float, default=1.0)
    p.add_argument("--world-size", type=int, default=8)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--batches", type=int, default=20)
    p.add_argument("--batch", type=int, default=65536, help="global batch; the planner's local batch is batch / W")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--baseline", default=None, help="git revision whose torchrec_herald to measure too")
    p.add_argument("--threads", type=int, nargs="+", default=None,
                   help="torch intra-op thread counts to measure at (default: torch's default)")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/planner_speed.json"))
    p.add_argument("--child", choices=["stats", "plan"], help=argparse.SUPPRESS)
    p.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--tag", help=argparse.SUPPRESS)
    p.add_argument("--child-out", type=Path, help=argparse.SUPPRESS)
    a = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", force=True)
    if a.child:
        if a.threads:
            torch.set_num_threads(a.threads[0])
        logging.getLogger("torchrec").setLevel(logging.ERROR)  # the stock planner's dry-run warnings
        logging.getLogger("torchrec_herald").setLevel(logging.WARNING)  # the plan printout, once per repeat
        res = (child_stats if a.child == "stats" else child_plan)(a, a.work, a.tag)
        a.child_out.write_text(json.dumps(res))
        return
    if a.batch % a.world_size:
        p.error("--batch must be a multiple of --world-size")
    command = "python benchmarks/planner_speed.py " + " ".join(
        f"--{k.replace('_', '-')} {' '.join(map(str, v)) if isinstance(v, list) else v}" for k, v in vars(a).items()
        if v is not None and k not in ("child", "work", "tag", "child_out"))
    a.out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="planner_speed_") as tmp:
        work = Path(tmp)
        generate(a, work)
        variants: Dict[str, Optional[Path]] = {"current": None}
        if a.baseline:
            variants = {"baseline": checkout(a.baseline, work), **variants}
        runs: Dict[str, Dict[str, Any]] = {}
        for threads in a.threads or [None]:
            for tag, code in variants.items():
                key = f"{tag}, threads={threads or torch.get_num_threads()}"
                runs[key] = {"from_batches": run_child(a, "stats", work, tag, code, threads),
                             "plan": run_child(a, "plan", work, tag, code, threads)}
    result: Dict[str, Any] = {
        "machine": machine(), "command": command,
        "config": {k: getattr(a, k) for k in CONFIG} | {"local_batch": a.batch // a.world_size},
        "runs": {key: {part: {k: v for k, v in r.items() if k != "expected"} for part, r in parts.items()}
                 for key, parts in runs.items()},
    }
    if a.baseline:
        result["baseline_revision"] = subprocess.run(["git", "-C", str(REPO), "rev-parse", a.baseline], check=True,
                                                     capture_output=True, text=True).stdout.strip()
        result["same_results"], result["speedup"] = {}, {}
        for threads in a.threads or [None]:
            n = threads or torch.get_num_threads()
            base, cur = runs[f"baseline, threads={n}"], runs[f"current, threads={n}"]
            result["same_results"][f"threads={n}"] = {
                "stats_counters": base["from_batches"]["counters_sha256"] == cur["from_batches"]["counters_sha256"],
                "plan_hot_rows_sync_layout": base["plan"]["plan_sha256"] == cur["plan"]["plan_sha256"],
                "expected_traffic_max_rel_diff": max_rel_diff(base["plan"]["expected"], cur["plan"]["expected"]),
            }
            result["speedup"][f"threads={n}"] = {part: base[part]["median_s"] / cur[part]["median_s"]
                                                 for part in ("from_batches", "plan")}
        log.info("same results: %s; speed-up %s", result["same_results"], result["speedup"])
    a.out.write_text(json.dumps(result, indent=2))
    log.info("wrote %s", a.out)


if __name__ == "__main__":
    main()
