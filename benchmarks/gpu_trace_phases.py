"""Where a profiled step's host time goes, by TorchRec pipeline phase, from ``gpu_step_time.py --profile
--trace`` timelines: each phase's host milliseconds, kernel launches, and the CUDA runtime calls in it that
block the host (synchronise, device-to-host copies, ``cudaMalloc``); with the device's busy time per step.

    python benchmarks/gpu_trace_phases.py benchmarks/results/gpu_ab_step_1126c/ab_new1_B8192.prof.trace.json.gz ...

The phases are TrainPipelineSparseDist's ``## name ##`` ranges (the profiler inflates every op's host
cost: compare traces with each other, and wall-clock steps with ``gpu_step_time.py``'s unprofiled figures).
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
from typing import Any, Dict, List

PHASES = ("zero_grad", "wait_for_batch", "start_sparse_data_dist", "copy_batch_to_gpu", "forward",
          "wait_sparse_data_dist", "backward", "optimizer")
BLOCKING = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpyAsync",
            "cudaMalloc", "cudaFree", "cudaHostAlloc")


def phases(path: str) -> Dict[str, Any]:
    """Per-step means of one trace: host span, device busy time, launches, and per phase (ms, launches,
    blocking runtime calls' ms)."""
    ev = [e for e in json.load(gzip.open(path))["traceEvents"] if e.get("ph") == "X"]
    ann = sorted((e for e in ev if e.get("cat") == "user_annotation" and e["name"].startswith("## ")
                  and e["name"].split()[1] in PHASES and e["name"] != "## wait_sparse_data_dist ##"),
                 key=lambda e: e["ts"])
    runtime = [e for e in ev if e.get("cat") == "cuda_runtime"]
    launches = [e for e in runtime if "Launch" in e["name"]]
    blocking = [e for e in runtime if e["name"] in BLOCKING]
    device = [e for e in ev if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    steps = sum(1 for a in ann if a["name"].startswith("## forward"))
    per: Dict[str, Dict[str, Any]] = {p: {"ms": 0.0, "launches": 0, "blocking_ms": collections.Counter()} for p in PHASES}
    for a in ann:
        p, s, t = a["name"].split()[1], a["ts"], a["ts"] + a["dur"]
        per[p]["ms"] += a["dur"] / 1e3 / steps
        per[p]["launches"] += sum(1 for e in launches if s <= e["ts"] < t) / steps
        for e in blocking:
            if s <= e["ts"] < t:
                per[p]["blocking_ms"][e["name"]] += e["dur"] / 1e3 / steps
    span = (max(a["ts"] + a["dur"] for a in ann) - min(a["ts"] for a in ann)) / 1e3 / steps
    return {"trace": path, "steps": steps, "host_span_ms": span, "device_busy_ms": sum(e["dur"] for e in device) / 1e3 / steps,
            "launches": len(launches) / steps, "phases": per}


def main(argv: List[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("traces", nargs="+")
    ap.add_argument("--out", help="also write the summaries here (JSON)")
    a = ap.parse_args(argv)
    rows = [phases(t) for t in a.traces]
    if a.out:
        with open(a.out, "w") as f:
            json.dump(rows, f, indent=1)
    for r in rows:
        print(f"{r['trace']}: {r['steps']} steps; per step: host {r['host_span_ms']:.2f} ms, device busy "
              f"{r['device_busy_ms']:.2f} ms, {r['launches']:.0f} launches")
        for p, v in r["phases"].items():
            b = ", ".join(f"{k} {ms:.2f}" for k, ms in v["blocking_ms"].most_common()) or "-"
            print(f"   {p:24s} {v['ms']:6.2f} ms  {v['launches']:4.0f} launches  blocking: {b}")


if __name__ == "__main__":
    main()
