"""The run-order bias narrowed: two identical runs in the same two ranks, with the first run's eval pass as the
trainer runs it (``full``) or with its eval batches read and no model run on them (``data_only``).

    python benchmarks/run_order_eval.py OUT_DIR full|data_only      (prints the two runs' samples/s)
"""

from __future__ import annotations

import sys

from run_order import worker
from torchrec_herald.dist_utils import run_multiprocess

if __name__ == "__main__":
    mode = sys.argv[2]
    runs = run_multiprocess(worker, 2, sys.argv[1], [], 2, mode == "data_only", timeout_s=600)[0]
    print(mode, [r[0] for r in runs])
