"""The model of time's validation (benchmarks/time_model.py) on four sessions' runs (this session's twice: at 20871d4 and at 5be5be3), each with its own inputs:

    .venv/bin/python benchmarks/results/twentysecond_1207/validate_sessions.py eighteenth twentieth twentyfirst twentysecond twentysecond_final
"""
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path[:0] = [str(ROOT / "benchmarks"), str(ROOT)]
import time_model as tm  # noqa: E402

SETS = {
    "eighteenth": (["eighteenth_1128/bw_w2_unl", "eighteenth_1128/bw_w2_lim", "eighteenth_1128/bw_w4_unl",
                    "eighteenth_1128/bw_w4_lim"],
                   ["eighteenth_1128/bw_w2_unl", "eighteenth_1128/bw_w4_unl", "eighteenth_1128/bw_w2_unl_hot",
                    "eighteenth_1128/bw_w4_unl_hot", "eighteenth_1128/bw_w2_unl_sched"]),
    "twentieth": (["twentieth_1207/bw_w2_unl", "twentieth_1207/bw_w2_lim", "twentieth_1207/bw_w4_unl",
                   "twentieth_1207/bw_w4_lim"],
                  ["eighteenth_1128/bw_w2_unl_hot", "eighteenth_1128/bw_w4_unl_hot", "eighteenth_1128/bw_w2_unl_sched",
                   "twentieth_1207/bw_w2_unl", "twentieth_1207/bw_w4_unl"]),
    "twentyfirst": (["twentyfirst_1207/bw_w2_unl", "twentyfirst_1207/bw_w2_lim", "twentyfirst_1207/bw_w4_unl",
                     "twentyfirst_1207/bw_w4_lim"],
                    ["twentyfirst_1207/bw_w2_unl", "twentyfirst_1207/bw_w2_unl_herald", "twentyfirst_1207/bw_w4_unl",
                     "twentyfirst_1207/bw_w4_unl_hot"]),
    "twentysecond": (["twentysecond_1207/bw_w2_unl", "twentysecond_1207/bw_w2_lim", "twentysecond_1207/bw_w4_unl",
                      "twentysecond_1207/bw_w4_lim"],
                     ["twentysecond_1207/bw_w2_unl", "twentysecond_1207/bw_w2_unl_herald", "twentysecond_1207/bw_w4_unl",
                      "twentysecond_1207/bw_w4_unl_hot"]),
    "twentysecond_final": (tm.VALIDATED, tm.UNLIMITED_RUNS),
}
for name in sys.argv[1:] or list(SETS):
    validated, unlimited = SETS[name]
    v = tm.validate(validated, unlimited=tm.unlimited_runs(unlimited))
    errs = [abs(p[k]["error"]) for p in v["points"] for k in ("stock_step_ms", "herald_step_ms", "ratio")]
    print(f"{name}: all-to-all share {v['a2a_share']:.3f}, all-reduce call {v['shared_core_allreduce_call_ms']:.2f} ms "
          f"where ranks share cores; within 15 %: {sum(e <= 0.15 for e in errs)} of {len(errs)}, worst {max(errs):.3f}")
    for p in v["points"]:
        print("  ", p["world_size"], p["rate_mbit"] or "unlimited", "(calibration)" if p["calibration_point"] else "",
              " ".join(f"{k}: {p[k]['measured']:.2f} / {p[k]['predicted']:.2f} ({100 * p[k]['error']:+.1f} %)"
                       for k in ("stock_step_ms", "herald_step_ms", "ratio")))
