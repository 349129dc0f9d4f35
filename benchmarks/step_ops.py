"""Ops and host synchronisations per training step, herald vs stock, counted with ``torch.profiler`` on CPU
(2 ranks, gloo), so the device-resident step's overhead is visible without a GPU.

    python benchmarks/step_ops.py [--steps 20] [--warmup 10] [--configs tw hot herald]

Every op a step runs is attributed to the model's forward (a range around ``DistributedModelParallel``'s
forward), its backward (autograd's engine) or the rest of the step (input distribution, planning, the
optimizer, ...). A *host sync* is an op that on a GPU makes the host wait for the device: reading a value
(``.item()``, ``int()``/``bool()`` of a tensor: ``aten::_local_scalar_dense``; ``.tolist()``, ``.numpy()``,
marked here by wrapping them), or an op whose output size depends on the data (``nonzero``, ``unique``,
``masked_select``, ``bincount``, ``argwhere``, ``repeat_interleave`` without an output size). On a CPU they
cost little; on a GPU each stalls the stream. Writes ``benchmarks/results/step_ops.json`` and the
STEP_OPS section of RESULTS.md.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

#: configuration -> (label, Hydra overrides); herald's plan is kept on loopback (planner.link_mbit=null)
CONFIGS: Dict[str, tuple] = {
    "tw": ("stock TABLE_WISE (TrainPipelineSparseDist)", ["planner=table_wise", "pipeline=sparse_dist"]),
    "hot": ("herald hot replication", ["planner=herald", "planner.link_mbit=null", "pipeline=sparse_dist"]),
    "herald": ("herald hot replication + scheduling", ["planner=herald", "planner.link_mbit=null", "pipeline=herald",
                                                      "pipeline.scheduling=on"]),
}
#: ops that make a GPU's host wait: they read a value or size their output by the data
SYNC_OPS = {"aten::_local_scalar_dense", "aten::nonzero", "aten::unique", "aten::_unique", "aten::_unique2",
            "aten::unique_consecutive", "aten::unique_dim", "aten::masked_select", "aten::bincount", "aten::argwhere",
            "aten::repeat_interleave", "host_sync::tolist", "host_sync::numpy"}
FORWARD, BACKWARD = "bench::forward", "autograd::engine::evaluate_function"


def _mark_host_reads() -> None:
    """``Tensor.tolist`` / ``Tensor.numpy`` dispatch no op: wrap them in a profiler range to count them."""
    import torch
    from torch.profiler import record_function

    for name in ("tolist", "numpy"):
        orig = getattr(torch.Tensor, name)

        def wrapped(self: torch.Tensor, *a: Any, _orig: Any = orig, _name: str = name, **k: Any) -> Any:
            with record_function(f"host_sync::{_name}"):
                return _orig(self, *a, **k)

        setattr(torch.Tensor, name, wrapped)


def _sync_sites(pipeline: Any, it: Any, steps: int, in_forward: List[bool]) -> Dict[str, int]:
    """Run ``steps`` more steps under a dispatch mode that records, for every sync op inside forward or
    backward, its innermost caller in herald's or TorchRec's code (``file:line``)."""
    import threading
    import traceback

    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    sites: Dict[str, int] = collections.Counter()
    names = {n.split("::")[1] for n in SYNC_OPS if n.startswith("aten::")}

    main = threading.main_thread()

    def record(op: str) -> None:
        if threading.current_thread() is not main:  # the scheduler thread works ahead, off the step
            return
        region = "backward" if torch._C._current_graph_task_id() != -1 else ("forward" if in_forward[0] else None)
        if region is None:
            return
        frames = [f for f in traceback.extract_stack()[:-2]
                  if any(p in f.filename for p in ("torchrec_herald", "/torchrec/", "/fbgemm_gpu/"))]
        f = frames[-1] if frames else None  # the innermost of herald, TorchRec and fbgemm
        where = "?" if f is None else f"{f.filename.split('site-packages/')[-1].split('/work/main/')[-1]}:{f.lineno}"
        owner = ("torch" if f is None else "herald" if "torchrec_herald" in f.filename else
                 "fbgemm" if "/fbgemm_gpu/" in f.filename else "torchrec")
        sites[f"{region} | {owner} | {op} | {where}"] += 1

    class Syncs(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            name = func.__name__.split(".")[0]
            # repeat_interleave waits for the device only when it must find its output size
            if name in names and not (name == "repeat_interleave" and (kwargs or {}).get("output_size") is not None):
                record(name)
            return func(*args, **(kwargs or {}))

    tolist = torch.Tensor.tolist

    def counted_tolist(self: torch.Tensor, *a: Any, **k: Any) -> Any:
        record("tolist")
        return tolist(self, *a, **k)

    torch.Tensor.tolist = counted_tolist  # type: ignore[method-assign]
    try:
        with Syncs():
            for _ in range(steps):
                pipeline.progress(it)
    finally:
        torch.Tensor.tolist = tolist  # type: ignore[method-assign]
    return sites


def _region(evt: Any) -> str:
    e = evt
    while e is not None:
        if e.name == FORWARD:
            return "forward"
        if e.name.startswith(BACKWARD):
            return "backward"
        e = e.cpu_parent
    return "rest"


def build_cpu_run(overrides: List[str], batches: int, rank: int, world: int) -> Tuple[Any, Any, Any, Any]:
    """One rank's training on CPU (one torch thread) with ``overrides`` and ``batches`` global batches of
    the default data: (the DMP, the pipeline, this rank's train stream, the link decision)."""
    import torch

    from torchrec_herald.config import compose_config
    from torchrec_herald.data import build_data_source
    from torchrec_herald.trainer import build_model_and_plan, build_pipeline, train_stream

    torch.set_num_threads(1)
    cfg = compose_config(overrides + [f"data.num_train_batches={batches}", "eval=false"])
    data = build_data_source(cfg.data)
    device = torch.device("cpu")
    dmp, optimizer, decision = build_model_and_plan(cfg, data, world, device)
    pipeline = build_pipeline(cfg, dmp, optimizer, device, decision)
    return dmp, pipeline, train_stream(data, rank, world, cfg.batch_size), decision


def worker(rank: int, world: int, config: str, steps: int, warmup: int) -> Dict[str, Any]:
    from torch.profiler import ProfilerActivity, profile, record_function

    dmp, pipeline, it, decision = build_cpu_run(CONFIGS[config][1], warmup + 2 * steps + 10, rank, world)
    forward = dmp.forward

    forward_flag = [False]

    def ranged_forward(*a: Any, **k: Any) -> Any:
        forward_flag[0] = True
        try:
            with record_function(FORWARD):
                return forward(*a, **k)
        finally:
            forward_flag[0] = False

    dmp.forward = ranged_forward  # type: ignore[method-assign]
    _mark_host_reads()
    for _ in range(warmup):
        pipeline.progress(it)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            pipeline.progress(it)
    ops: Dict[str, int] = collections.Counter()
    syncs: Dict[str, Dict[str, int]] = collections.defaultdict(collections.Counter)
    for e in prof.events():
        if not (e.name.startswith("aten::") or e.name.startswith("host_sync::")):
            continue
        region = _region(e)
        if e.name.startswith("aten::"):
            ops[region] += 1
        if e.name in SYNC_OPS:
            syncs[region][e.name] += 1
    sites = _sync_sites(pipeline, it, steps, forward_flag)
    pipeline.detach()
    return {"config": config, "label": CONFIGS[config][0], "steps": steps, "trained": decision.herald,
            "aten_ops_per_step": {r: n / steps for r, n in ops.items()},
            "host_syncs_per_step": {r: sum(c.values()) / steps for r, c in syncs.items()},
            "host_syncs_by_op_per_step": {r: {k: v / steps for k, v in c.items()} for r, c in syncs.items()},
            # syncs inside forward and backward by who calls them (herald's code, or TorchRec / torch)
            "fwd_bwd_syncs_by_caller_per_step": {k: v / steps for k, v in sites.most_common()}}


def markdown(rows: List[Dict[str, Any]], command: str) -> str:
    lines = [f"Command: `{command}` (rank 0, per step. Ops: torch.profiler; forward: inside the model's forward, "
             "backward: autograd, rest: input distribution, scheduling, optimizer. Syncs inside forward and backward: "
             "a dispatch mode on the training thread, each named by its innermost caller among herald, TorchRec "
             "and fbgemm)", "",
             "| configuration | aten ops forward / backward / rest | host syncs in forward / backward | "
             "by caller | herald's own, where |", "|---|---|---|---|---|"]
    for r in rows:
        o = r["aten_ops_per_step"]
        region, owner, own = collections.Counter(), collections.Counter(), collections.Counter()
        for k, v in r["fwd_bwd_syncs_by_caller_per_step"].items():
            reg, who, op, where = k.split(" | ")
            region[reg] += v
            owner[who] += v
            if who == "herald":
                own[f"{reg}: {op} ({where.split('/')[-1]})"] += v
        by = ", ".join(f"{w} {v:g}" for w, v in owner.most_common()) or "none"
        mine = "; ".join(f"{k} {v:g}" for k, v in own.most_common()) or "none"
        lines.append(f"| {r['label']} | {o.get('forward', 0):.0f} / {o.get('backward', 0):.0f} / {o.get('rest', 0):.0f} | "
                     f"{region.get('forward', 0):g} / {region.get('backward', 0):g} | {by} | {mine} |")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> None:
    from bench_traffic import write_results_md  # RESULTS.md's marked sections, one writer for every benchmark
    from torchrec_herald.dist_utils import run_multiprocess

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    ap.add_argument("--out", default=str(HERE / "results" / "step_ops.json"))
    a = ap.parse_args(argv)
    command = "python benchmarks/step_ops.py" + (" " + " ".join(argv) if argv else "")
    rows = [run_multiprocess(worker, 2, c, a.steps, a.warmup)[0] for c in a.configs]
    Path(a.out).write_text(json.dumps({"command": command, "rows": rows}, indent=1))
    md = markdown(rows, command)
    write_results_md({"STEP_OPS": md})
    print(md)


if __name__ == "__main__":
    main(sys.argv[1:])
