"""Compare the TABLE_WISE plan stock planner=table_wise makes with the one herald's planner falls back to."""
import json
import sys
from pathlib import Path


def _plan(rank: int, world: int, overrides: list) -> dict:
    import torch
    from torchrec_herald.config import compose_config
    from torchrec_herald.data import build_data_source
    from torchrec_herald.trainer import build_model_and_plan

    torch.set_num_threads(1)
    cfg = compose_config(overrides + ["data.num_train_batches=60", "eval=false"])
    data = build_data_source(cfg.data)
    dmp, opt, decision = build_model_and_plan(cfg, data, world, torch.device("cpu"))
    out = {}
    for mod, mp in dmp.plan.plan.items():
        for t, ps in mp.items():
            out[t] = (ps.sharding_type, ps.compute_kernel, str(ps.ranks), str(getattr(ps, "cache_params", None)))
    return {"plan": out, "model": str(type(dmp._dmp_wrapped_module if hasattr(dmp, "_dmp_wrapped_module") else dmp)),
            "opt": str(type(opt)), "fused": repr(getattr(dmp, "fused_optimizer", None))[:300]}


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
    from torchrec_herald.dist_utils import run_multiprocess
    a = run_multiprocess(_plan, 2, ["planner=table_wise"])[0]
    b = run_multiprocess(_plan, 2, ["planner=herald", "pipeline=herald", "planner.link_mbit=100000"])[0]
    diff = {t: (a["plan"][t], b["plan"].get(t)) for t in a["plan"] if a["plan"][t] != b["plan"].get(t)}
    print("same plan" if not diff else json.dumps(diff, indent=1))
    print(a["model"], b["model"]); print(a["opt"], b["opt"]); print(a["fused"]); print(b["fused"])
