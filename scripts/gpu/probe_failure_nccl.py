"""The start-up link probe failing on one rank over NCCL (needs 2 GPUs; no lent machine has had them yet): rank 1's
probe fails before an all-to-all rank 0 enters. Rank 0 must give up at the probe's host deadline, both ranks must
abort the probe's group and warn once, and the job's NCCL group must still carry a sum after the probe group's own
timeout has passed (NCCL's watchdog would end a process whose collective timed out in a group not aborted).
``tests/test_link_model.py`` checks the same path over gloo.

    torchrun --nproc-per-node 2 scripts/gpu/probe_failure_nccl.py --out $OUT/probe_failure_nccl.json [--fail-at all_reduce]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

from torchrec_herald.dist_utils import default_backend, local_device
from torchrec_herald.planner import link_probe


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--timeout-s", type=float, default=5.0, help="the probe's timeout (its group's: twice that)")
    ap.add_argument("--fail-at", choices=["all_reduce", "all_to_all_single"], default="all_to_all_single",
                    help="the probe's first all-reduces (its group's first collective, which connects NCCL's "
                         "communicator) or its first all-to-all (the first use of a pair's channels)")
    args = ap.parse_args()
    dist.init_process_group(default_backend())
    rank, device = dist.get_rank(), local_device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    lines = _Lines()
    logging.getLogger("torchrec_herald.planner").addHandler(lines)
    if rank == 1:  # (the probe's own group only: the job's agreement and sum after it run as they should)
        real = getattr(dist, args.fail_at)

        def broken(*a: object, **k: object) -> object:
            if k.get("group") not in (None, dist.group.WORLD):
                raise RuntimeError("out of memory on rank 1 alone")
            return real(*a, **k)
        setattr(dist, args.fail_at, broken)
    t0 = time.monotonic()
    probe = link_probe.probe_on_every_rank(dist.group.WORLD, timeout_s=args.timeout_s)
    probe_s = time.monotonic() - t0
    time.sleep(2 * args.timeout_s + 5)  # past the probe group's timeout: its watchdog would have fired by now
    total = torch.tensor([rank + 1.0], device=device)
    dist.all_reduce(total)
    result = {"rank": rank, "probe": None if probe is None else probe.as_dict(), "warnings": lines.lines,
              "probe_s": round(probe_s, 2), "sum_after": total.item(), "backend": dist.get_backend(),
              "ok": probe is None and total.item() == 3.0 and len(lines.lines) == 1}
    print(json.dumps(result), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    Path(f"{args.out}.rank{rank}").write_text(json.dumps(result, indent=1))
    dist.destroy_process_group()
    os._exit(0 if result["ok"] else 1)


if __name__ == "__main__":
    main()
