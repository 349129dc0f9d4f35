"""Non-view aten ops a training step runs at one rank, on CPU, through the code path ids take on a GPU.

On a GPU herald's step is bound by its host (the device is busy about 1 ms of a 6-8 ms step), so the ops it
dispatches, each a kernel launch or more, are its cost. The compiled passes (``native/``) run only where
the ids are on the CPU; ``--torch-ids`` turns them off here so the count is the GPU path's. Each op is
attributed to the innermost herald, TorchRec or fbgemm frame that issued it (a dispatch mode over the
steps), so an A/B of two trees shows where the ops went.

    python benchmarks/gpu_path_ops.py --torch-ids -- planner=table_wise pipeline=sparse_dist
    python benchmarks/gpu_path_ops.py --torch-ids -- planner=herald pipeline=herald pipeline.scheduling=off \
        planner.link_mbit=null
    python benchmarks/gpu_path_ops.py --faults --batch-size 2048 -- planner=herald pipeline=herald ...
"""

from __future__ import annotations

import argparse
import collections
import os
import resource
import sys
import traceback
from pathlib import Path
from typing import Any, Counter, Dict

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode

from gpu_path import add_training_arguments, build_training, use_gpu_code_path  # benchmarks/gpu_path.py  # noqa: E402

#: frames an op is attributed to (the innermost of them)
PACKAGES = ("torchrec_herald", "/torchrec/", "fbgemm")
#: ops that launch nothing: views and aliases, besides those torch marks as views
NO_KERNEL = {"detach", "alias", "lift_fresh"}


def _site() -> str:
    """The innermost herald, TorchRec or fbgemm frame of the current op's call (``file:line``)."""
    for frame in reversed(traceback.extract_stack(limit=40)[:-2]):
        if any(p in frame.filename for p in PACKAGES):
            return f"{frame.filename.split('site-packages/')[-1].split(os.getcwd() + '/')[-1]}:{frame.lineno}"
    return "?"


class OpCounter(TorchDispatchMode):
    """Counts every non-view op dispatched, by (innermost package frame, op name); with ``faults``, the
    process's minor page faults each op takes instead (every op, views included)."""

    def __init__(self, faults: bool = False) -> None:
        super().__init__()
        self.ops: Counter[str] = collections.Counter()
        self.faults = faults

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = func.overloadpacket.__name__
        if self.faults:
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            out = func(*args, **(kwargs or {}))
            taken = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
            if taken:
                self.ops[f"{_site()} {name}"] += taken
            return out
        if not getattr(func, "is_view", False) and name not in NO_KERNEL:
            self.ops[f"{_site()} {name}"] += 1
        return func(*args, **(kwargs or {}))


def count(overrides: list, batch_size: int, steps: int, warmup: int, torch_ids: bool, no_extension: bool = False,
          faults: bool = False, loader: str = "stream") -> Dict[str, float]:
    """Ops (with ``faults``: minor page faults) per step of ``steps`` steps after ``warmup``, by site and op, on
    the training thread (a dispatch mode is the thread's own: herald's run-ahead thread is not counted)."""
    if torch_ids:  # the path of ids and rows on a GPU: the compiled passes over ids or rows off
        use_gpu_code_path(no_extension)
    _, _, pipeline, it, _ = build_training(overrides, batch_size, warmup + steps, loader)
    for _ in range(warmup):
        pipeline.progress(it)
    counter = OpCounter(faults)
    with counter:
        for _ in range(steps):
            pipeline.progress(it)
    return {k: v / steps for k, v in counter.ops.most_common()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_training_arguments(p, batch_size=2048, steps=5, warmup=8)
    p.add_argument("--no-extension", action="store_true",
                   help="with --torch-ids: no compiled pass at all (a GPU host where the extension is not built)")
    p.add_argument("--faults", action="store_true", help="minor page faults per step by site and op, not ops")
    p.add_argument("--top", type=int, default=40, help="sites to list")
    a = p.parse_args()
    ops = count(a.overrides, a.batch_size, a.steps, a.warmup, a.torch_ids, a.no_extension, a.faults, a.loader)
    print(f"{'minor page faults inside ops' if a.faults else 'non-view aten ops'} per step: {sum(ops.values()):.1f}")
    for site, n in list(ops.items())[: a.top]:
        print(f"{n:7.1f} {site}")


if __name__ == "__main__":
    main()
