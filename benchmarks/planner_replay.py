"""The sync planner's own cost per step, away from training: capture rank 0's planner and the windows a real
run feeds it, then replay them on one thread.

In a training run the planner shares its process (and Python's GIL) with the training thread, and on this
host two ranks share two cores, so the time its thread spends per step says little about the planner
itself. Replaying the captured windows on a quiet thread gives its own cost, the same for every variant of
the planner code (an A/B of a planner change: capture once, replay before and after; the plans replayed
are compared too, so a faster variant that plans differently is caught).

    python benchmarks/planner_replay.py capture --out /tmp/exact.pkl [overrides ...]
    python benchmarks/planner_replay.py replay /tmp/exact.pkl [--repeats 5] [--impl python|compiled|both]
        [--profile] [--json out.json]

``capture`` trains 2 ranks on CPU (gloo) with ``planner=herald pipeline=herald pipeline.scheduling=on
planner.link_mbit=200`` plus the overrides (e.g. ``pipeline.staleness=3 pipeline.reference=false`` for
HET's planner), ``--steps`` global batches, and pickles rank 0's planner as it was at its first
``plan_step`` with every window it was given (the run's own ``metrics.json`` is kept beside it, in
``<out>.run0``, and ``replay`` reports its planner time next to the replayed one).
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import io
import json
import pickle
import pstats
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Dict, List

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

# the tensor planner is captured (it can be copied); replay builds the compiled one from it (--impl)
BASE_OVERRIDES = ["planner=herald", "pipeline=herald", "pipeline.scheduling=on", "planner.link_mbit=200",
                  "pipeline.scheduler_impl=python"]


def _capture_rank(rank: int, world: int, overrides: List[str], steps: int, out: str) -> int:
    from torchrec_herald.config import compose_config
    from torchrec_herald.pipeline.lazy_sync import TensorLazySyncPlanner
    from torchrec_herald.pipeline.staleness import StalenessPlanner
    from torchrec_herald.trainer import Trainer

    record: Dict[str, Any] = {"planner": None, "windows": [], "overrides": overrides}
    for cls in (TensorLazySyncPlanner, StalenessPlanner):  # wrap each class's own plan_step once
        own = cls.__dict__["plan_step"]

        def recording(self: Any, window: Any, _own: Any = own) -> Any:
            if rank == 0:
                if record["planner"] is None:
                    record["planner"] = copy.deepcopy(self)
                record["windows"].append([[t.clone() for t in reads] for reads in window])
            return _own(self, window)

        cls.plan_step = recording  # type: ignore[method-assign]
    cfg = compose_config(overrides + [f"data.num_train_batches={steps}", "eval=false"])
    Trainer(cfg, Path(out).with_suffix(f".run{rank}"), show_progress=False).build().train()
    if rank == 0:
        if record["planner"] is None:
            raise RuntimeError(f"no plan_step ran with {overrides}: is scheduling on and the plan lazy?")
        with open(out, "wb") as f:
            pickle.dump(record, f)
    return len(record["windows"])


def capture(out: str, overrides: List[str], steps: int) -> None:
    from torchrec_herald.dist_utils import run_multiprocess

    n = run_multiprocess(_capture_rank, 2, BASE_OVERRIDES + overrides, steps, out, timeout_s=3600)[0]
    print(f"captured {n} windows of rank 0's {BASE_OVERRIDES + overrides} planner into {out}")


def _plans_equal(a: Any, b: Any) -> bool:
    import torch

    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and bool(torch.equal(a, b))
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_plans_equal(x, y) for x, y in zip(a, b))
    if hasattr(a, "__dict__"):
        return type(a) is type(b) and _plans_equal(vars(a), vars(b))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_plans_equal(a[k], b[k]) for k in a)
    return a == b


def _fresh(captured: Any, impl: str) -> Any:
    """A planner in the captured one's state (its first step): a copy of the tensor planner, or the
    compiled planner of the same layout, capacities, window (and staleness)."""
    if impl == "python":
        return copy.deepcopy(captured)
    from torchrec_herald.pipeline.lazy_sync_native import CompiledLazySyncPlanner, CompiledStalenessPlanner
    from torchrec_herald.pipeline.staleness import StalenessPlanner

    caps = {t: int(c) for t, c in zip(captured.layout.tables, captured.capacity)}
    if isinstance(captured, StalenessPlanner):
        return CompiledStalenessPlanner(captured.layout, captured.staleness, window=captured.window, capacity_rows=caps)
    return CompiledLazySyncPlanner(captured.layout, window=captured.window, capacity_rows=caps)


def replay(path: str, repeats: int, profile: bool, json_out: str | None, impl: str = "python") -> None:
    import torch

    torch.set_num_threads(1)
    with open(path, "rb") as f:
        record = pickle.load(f)
    if impl == "both":
        out = {}
        for one in ("python", "compiled"):
            replay(path, repeats, False, None, one)
            with open(Path(path).with_suffix(".plans"), "rb") as f:
                out[one] = pickle.load(f)
        print("the compiled planner made the same plans" if _plans_equal(out["python"], out["compiled"])
              else "the compiled planner's plans differ")
        return
    windows = record["windows"]
    times, plans_first = [], None
    for _ in range(repeats):
        planner = _fresh(record["planner"], impl)
        t0 = time.perf_counter()
        plans = [planner.plan_step(w) for w in windows]
        times.append((time.perf_counter() - t0) / len(windows))
        if plans_first is None:
            plans_first = plans
        elif not _plans_equal(plans_first, plans):
            raise RuntimeError("two replays of the same windows planned differently")
    res = {"capture": path, "overrides": record["overrides"], "planner": type(planner).__name__,
           "steps": len(windows), "repeats": repeats, "ms_per_step_median": 1e3 * statistics.median(times),
           "ms_per_step_all": [1e3 * t for t in times]}
    live = Path(path).with_suffix(".run0") / "metrics.json"  # the captured run's own figure, if kept
    if live.exists():
        herald = json.loads(live.read_text()).get("herald_pipeline", {})
        res["live_planner_ms_per_step"] = herald.get("planner_ms_per_step")
        res["live_scheduler_thread_ms_per_step"] = herald.get("scheduler_overlapped_ms_per_step")
    print(json.dumps(res, indent=1))
    if profile:
        prof = cProfile.Profile()
        planner = _fresh(record["planner"], impl)
        prof.enable()
        for w in windows:
            planner.plan_step(w)
        prof.disable()
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(20)
        print(s.getvalue())
    if json_out:
        Path(json_out).write_text(json.dumps(res, indent=1))
    if plans_first is not None:
        with open(Path(path).with_suffix(".plans"), "wb") as f:
            pickle.dump(plans_first, f)  # to compare with another variant's plans (compare_plans below)


def compare_plans(a: str, b: str) -> None:
    with open(a, "rb") as fa, open(b, "rb") as fb:
        same = _plans_equal(pickle.load(fa), pickle.load(fb))
    print("same plans" if same else "the plans differ")
    if not same:
        sys.exit(1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("capture")
    c.add_argument("--out", required=True)
    c.add_argument("--steps", type=int, default=150)
    c.add_argument("overrides", nargs="*")
    r = sub.add_parser("replay")
    r.add_argument("capture")
    r.add_argument("--repeats", type=int, default=5)
    r.add_argument("--impl", choices=["python", "compiled", "both"], default="python")
    r.add_argument("--profile", action="store_true")
    r.add_argument("--json")
    p = sub.add_parser("compare", help="two replays' .plans files: the same plans?")
    p.add_argument("a")
    p.add_argument("b")
    a = ap.parse_args()
    if a.cmd == "capture":
        capture(a.out, a.overrides, a.steps)
    elif a.cmd == "replay":
        replay(a.capture, a.repeats, a.profile, a.json, a.impl)
    else:
        compare_plans(a.a, a.b)


if __name__ == "__main__":
    main()
