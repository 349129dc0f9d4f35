"""What reading one batch of the synthetic data costs: a global batch (what a scheduling rank's scheduler
thread reads) and one rank's slice (what hot replication alone reads), with the compiled inverse-CDF
sampling (native/synthetic_sample.cpp) and with the torch ops it replaces, on one thread.

    python benchmarks/synthetic_read.py [--batches 300] [--batch-size 256] [--world 2]

Prints CPU ms per batch (``time.thread_time``, fresh draws each batch: a fixed batch would let the
branch predictor learn the torch search's pattern) and checks both give the same batches.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=256, help="per rank")
    p.add_argument("--world", type=int, default=2)
    a = p.parse_args()

    import torch

    from torchrec_herald.data.synthetic import SyntheticCriteo

    torch.set_num_threads(1)
    compiled, ops = SyntheticCriteo(), SyntheticCriteo()
    if compiled._sampler._native is None:
        raise SystemExit("herald's compiled module is not built: run `make setup`")
    ops._sampler._native = None
    G = a.world * a.batch_size
    print(f"{'source':<10} {'read':<22} {'CPU ms per batch':>16}")
    for name, rows in ((f"global batch of {G}", slice(None)), (f"one rank's {a.batch_size}", slice(0, a.batch_size))):
        for label, src in (("compiled", compiled), ("torch ops", ops)):
            for i in range(10):
                src.global_batch("train", i, G, rows)
            t0 = time.thread_time()
            for i in range(a.batches):
                src.global_batch("train", i, G, rows)
            print(f"{label:<10} {name:<22} {(time.thread_time() - t0) / a.batches * 1e3:>16.3f}")
    for i in range(5):
        x, y = compiled.global_batch("train", i, G), ops.global_batch("train", i, G)
        assert all((u is None and v is None) or torch.equal(u, v) for u, v in zip(x, y)), f"batch {i} differs"
    print("same batches: yes")


if __name__ == "__main__":
    main()
