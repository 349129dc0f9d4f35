"""The model of time's validation (``time_model.validate``) on each session's committed ``bench_bandwidth`` runs,
each set with its own inputs (the same session's unlimited-link runs give each plan's compute):

    .venv/bin/python benchmarks/validate_sessions.py [SET ...]     (default: every set)

Prints, per set, how many of its figures (each point's stock step, herald step and ratio) the model predicts within
15 %, and each point's measured / predicted figures."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Dict, List, Optional, Tuple

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]
import time_model as tm  # noqa: E402


def _plain(folder: str) -> Tuple[List[str], List[str]]:
    """A session's run folder holding the runs ``time_model`` validates and the unlimited-link runs of each plan."""
    return [f"{folder}/{n}" for n in tm.VALIDATED_NAMES], [f"{folder}/{n}" for n in tm.UNLIMITED_NAMES]


#: set name -> (the runs validated, the runs whose unlimited rows give each plan's compute)
SETS: Dict[str, Tuple[List[str], List[str]]] = {
    "eighteenth": (["eighteenth_1128/" + n for n in tm.VALIDATED_NAMES],
                   ["eighteenth_1128/" + n for n in ("bw_w2_unl", "bw_w4_unl", "bw_w2_unl_hot", "bw_w4_unl_hot",
                                                      "bw_w2_unl_sched")]),
    "twentieth": (["twentieth_1207/" + n for n in tm.VALIDATED_NAMES],
                  ["eighteenth_1128/bw_w2_unl_hot", "eighteenth_1128/bw_w4_unl_hot", "eighteenth_1128/bw_w2_unl_sched",
                   "twentieth_1207/bw_w2_unl", "twentieth_1207/bw_w4_unl"]),
    "twentyfirst": _plain("twentyfirst_1207"),
    "twentysecond": _plain("twentysecond_1207"),
    "twentysecond_final": _plain("twentysecond_1207/final_5be5be3"),
    "twentythird": _plain("twentythird_1207"),
    "twentyfourth": _plain("twentyfourth_1207"),
    "twentyfifth_threaded_probe": _plain("twentyfifth_1207"),
    "twentyfifth": _plain("twentyfifth_1207/final"),
}


def main(names: Optional[List[str]] = None) -> None:
    for name in names or list(SETS):
        validated, unlimited = SETS[name]
        v = tm.validate(validated, unlimited=tm.unlimited_runs(unlimited))
        errs = [abs(p[k]["error"]) for p in v["points"] for k in ("stock_step_ms", "herald_step_ms", "ratio")]
        print(f"{name}: all-to-all share {v['a2a_share']:.3f}, all-reduce call {v['shared_core_allreduce_call_ms']:.2f} "
              f"ms where ranks share cores; within 15 %: {sum(e <= 0.15 for e in errs)} of {len(errs)}, worst "
              f"{max(errs):.3f}")
        for p in v["points"]:
            print("  ", p["world_size"], p["rate_mbit"] or "unlimited", "(calibration)" if p["calibration_point"] else "",
                  " ".join(f"{k}: {p[k]['measured']:.2f} / {p[k]['predicted']:.2f} ({100 * p[k]['error']:+.1f} %)"
                           for k in ("stock_step_ms", "herald_step_ms", "ratio")))


if __name__ == "__main__":
    main(sys.argv[1:])
