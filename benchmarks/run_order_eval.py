"""The run-order bias narrowed: two identical runs in the same two ranks, with the first run's eval pass as the
trainer runs it (``full``) or with its eval batches read and no model run on them (``data_only``).

    python benchmarks/run_order_eval.py OUT_DIR full|data_only      (prints the two runs' samples/s)
"""
import os, sys
from torchrec_herald.dist_utils import run_multiprocess

def worker(rank, world, out, mode):
    import gc
    from torchrec_herald.config import compose_config
    import torchrec_herald.trainer as T
    if mode == "data_only":  # the eval batches read, no model run
        T.evaluate = lambda dmp, batches, device: ([None for _ in batches], {"auc": 0.5, "logloss": 0.7})[1]
    res = []
    for i in range(2):
        m = T.run_training(compose_config(["planner=table_wise"]), f"{out}/r{i}")
        gc.collect()
        res.append(round(m["samples_per_s"]))
    return res

if __name__ == "__main__":
    print(sys.argv[2], run_multiprocess(worker, 2, sys.argv[1], sys.argv[2], timeout_s=600)[0])
