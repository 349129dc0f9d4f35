"""Herald's fallback (TABLE_WISE picked) vs stock TABLE_WISE in one job each, no netns: gc-tracked objects,
one full collection's time, RSS, gen2 collections during the timed steps, and the steps' time."""
import gc
import json
import resource
import statistics
import sys
import time


def _run(rank: int, world: int, overrides: list, freeze: bool) -> dict:
    import torch
    from torchrec_herald.config import compose_config
    from torchrec_herald.data import build_data_source
    from torchrec_herald.trainer import build_model_and_plan, build_pipeline, train_stream

    torch.set_num_threads(1)
    cfg = compose_config(overrides + ["data.num_train_batches=400", "eval=false"])
    data = build_data_source(cfg.data)
    dmp, opt, decision = build_model_and_plan(cfg, data, world, torch.device("cpu"))
    pipe = build_pipeline(cfg, dmp, opt, torch.device("cpu"), decision)
    it = train_stream(data, rank, world, cfg.batch_size)
    for _ in range(40):
        pipe.progress(it)
    if freeze:
        gc.collect(); gc.freeze()
    n_obj = len(gc.get_objects())
    t0 = time.perf_counter(); gc.collect(); gc_s = time.perf_counter() - t0
    g0 = gc.get_stats()[2]["collections"]
    seg = []
    for _ in range(6):
        t0 = time.perf_counter()
        for _ in range(50):
            out = pipe.progress(it)
        out[0].item()
        seg.append(time.perf_counter() - t0)
    return {"objects": n_obj, "gc_ms": 1000 * gc_s, "gen2": gc.get_stats()[2]["collections"] - g0,
            "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "step_ms": 1000 * statistics.median(seg) / 50, "chosen": decision.link_report().get("chosen") if decision.link_report() else None}


if __name__ == "__main__":
    from torchrec_herald.dist_utils import run_multiprocess
    freeze = "--freeze" in sys.argv
    for rep in range(3):
        for name, ov in (("tw", ["planner=table_wise"]), ("herald", ["planner=herald", "pipeline=herald"])):
            r = run_multiprocess(_run, 2, ov, freeze)
            print(rep, name, json.dumps({k: (round(v, 2) if isinstance(v, float) else v) for k, v in r[0].items()}),
                  "rank1 step", round(r[1]["step_ms"], 2), flush=True)
