"""DLRM training step time on one rank (stock TorchRec or herald), batches pre-generated on the device.

The model, plan and pipeline are the trainer's own (``build_model_and_plan`` / ``build_pipeline`` from a
Hydra-composed ``conf/train.yaml``), so the step is exactly the one ``python -m torchrec_herald.train``
runs; data generation is taken out of the timing (batches are made on CPU first, and each pipeline
copies them to the device as it would a data loader's).
Every step ends with a device synchronisation (the loss is read back), as in the trainer.

    python benchmarks/gpu_step_time.py --batch-sizes 2048 8192 --out benchmarks/results/gpu_step_time.json
    python benchmarks/gpu_step_time.py --overrides planner=herald pipeline=sparse_dist ...
    python benchmarks/gpu_step_time.py --overrides planner=herald ... --baseline planner=table_wise pipeline=sparse_dist

With ``--baseline`` both configurations are built in one process and their steps interleaved (rounds of
``--block`` steps each, ABBA order): the ratio then compares steps on the same host state.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import resource
import statistics
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from gpu_path import add_loader_argument, build_training, use_gpu_code_path  # benchmarks/gpu_path.py
from machine_info import machine  # benchmarks/machine_info.py

log = logging.getLogger("gpu_step_time")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _python_profile(pipeline: Any, it: Any, device: torch.device, steps: int) -> str:
    """``steps`` more steps under ``cProfile``: which Python functions the host's time per step goes to
    (the step on a GPU is host-bound; torch.profiler names the aten ops, not the Python that issues them)."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        pipeline.progress(it)
        _sync(device)
    prof.disable()
    text = io.StringIO()
    stats = pstats.Stats(prof, stream=text).strip_dirs()
    text.write(f"\n\n== cProfile over {steps} steps, by own time\n")
    stats.sort_stats("tottime").print_stats(45)
    text.write(f"\n== cProfile over {steps} steps, by cumulative time\n")
    stats.sort_stats("cumulative").print_stats(60)
    return text.getvalue()


def _profile(pipeline: Any, it: Any, device: torch.device, steps: int, out: Path, trace: bool = False) -> Dict[str, Any]:
    """``steps`` more steps under ``torch.profiler``: the top ops by self host time and by device time
    written to ``out`` (text), and the host-device synchronisations per step (the CUDA runtime calls that
    block the host: stream/device synchronise and device-to-host copies); with ``trace``, the timeline too
    (Chrome trace, gzipped, beside ``out``: where the host waits for the device)."""
    from torch.profiler import ProfilerActivity, profile

    out.parent.mkdir(parents=True, exist_ok=True)  # (before the trace's export, which writes beside ``out``)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        for _ in range(steps):
            pipeline.progress(it)
            _sync(device)
    if trace:
        import gzip

        raw = out.with_suffix(".trace.json")
        prof.export_chrome_trace(str(raw))
        with open(raw, "rb") as f, gzip.open(str(raw) + ".gz", "wb") as g:
            g.write(f.read())
        raw.unlink()
    avg = prof.key_averages()
    sync_names = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")
    syncs = {e.key: e.count / steps for e in avg if e.key.startswith(sync_names)}
    dev_key = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    out.write_text(f"totals over {steps} steps (divide by {steps} for one step)\n\n== by self host time\n"
                   + avg.table(sort_by="self_cpu_time_total", row_limit=30)
                   + f"\n\n== by {dev_key}\n" + avg.table(sort_by=dev_key, row_limit=30)
                   + _python_profile(pipeline, it, device, steps))
    return {"profiled_steps": steps, "host_syncs_per_step": syncs, "profile": str(out)}


def _build(batch_size: int, overrides: List[str], n: int, loader: str) -> tuple:
    """The trainer's model, plan and pipeline for ``overrides`` and an iterator over ``n`` batches made first
    (on CPU, as a data loader yields them: each pipeline moves its batches to the device), fed as ``loader``
    says (``gpu_path.build_training``)."""
    _, world, pipeline, it, device = build_training(overrides, batch_size, n, loader)
    return pipeline, it, device, world


def _timed_step(pipeline: Any, it: Any, device: torch.device) -> float:
    """Seconds of one step, ending in a device synchronisation (the loss read back, as in the trainer)."""
    return _timed_step_both(pipeline, it, device)[0]


def _timed_step_both(pipeline: Any, it: Any, device: torch.device) -> Tuple[float, float, int]:
    """Wall seconds of one step (as :func:`_timed_step`), the CPU seconds the training thread spent in it, and
    the process's minor page faults in it. On a GPU the step is bound by its host, and on a CPU at a small
    batch (``--torch-ids``) that thread's CPU is the host work a GPU's step would queue, without the waits and
    preemptions that make wall time noisy. The faults show where a CPU step pays the kernel for fresh pages:
    glibc hands a large freed buffer back to the system and the next step's allocation of it faults again."""
    _sync(device)
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    c0, t0 = time.thread_time(), time.perf_counter()
    out = pipeline.progress(it)
    out[0].item() if isinstance(out, tuple) else None
    _sync(device)
    wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
    return wall, cpu, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0


def measure(batch_size: int, overrides: List[str], warmup: int, steps: int,
            profile_out: Optional[Path] = None, trace: bool = False, loader: str = "stream") -> Dict[str, Any]:
    """Per-step seconds (median, mean, p90) of ``steps`` timed steps after ``warmup`` steps; with
    ``profile_out``, 5 more steps profiled (:func:`_profile`), then 5 under cProfile."""
    n = warmup + steps + 2 + (10 if profile_out else 0)  # TrainPipelineSparseDist runs ahead by up to two batches
    pipeline, it, device, world = _build(batch_size, overrides, n, loader)
    times = [_timed_step(pipeline, it, device) for _ in range(warmup + steps)][warmup:]
    prof = _profile(pipeline, it, device, 5, profile_out, trace) if profile_out else {}
    times.sort()
    med = statistics.median(times)
    res = {"local_batch": batch_size, "world_size": world, "device": str(device),
           "overrides": overrides, "loader": loader, "steps_timed": steps, "warmup": warmup,
           "step_s_median": med, "step_s_mean": statistics.fmean(times),
           "step_s_p90": times[int(0.9 * (len(times) - 1))], "samples_per_s": batch_size * world / med, **prof}
    log.info("B=%d %s: %.2f ms/step median (%.0f samples/s)", batch_size, " ".join(overrides), 1e3 * med,
             res["samples_per_s"])
    return res


def _column(steps: List[Tuple[float, float, int]], i: int) -> List[Any]:
    """Field ``i`` of each step's (wall seconds, thread CPU seconds, minor faults)."""
    return [step[i] for step in steps]


def measure_pair(batch_size: int, overrides: List[str], baseline: List[str], warmup: int, rounds: int,
                 block: int, loader: str = "stream") -> Dict[str, Any]:
    """``overrides`` against ``baseline`` in one process, their steps interleaved: ``rounds`` rounds of
    ``block`` steps of each, in ABBA order, after ``warmup`` steps of each. A lent machine's host drifts by
    tens of percent between runs (RESULTS.md), so separate runs cannot resolve a 10 % difference; steps
    interleaved this way see the same host. Reports each one's median step and the median of the rounds'
    ratios (``overrides`` over ``baseline``)."""
    n = warmup + rounds * block + 2
    runs = {"a": _build(batch_size, overrides, n, loader), "b": _build(batch_size, baseline, n, loader)}
    samples: Dict[str, List[Tuple[float, float, int]]] = {"a": [], "b": []}  # per step: wall s, thread CPU s, faults
    for key, (pipeline, it, device, _) in runs.items():
        for _ in range(warmup):
            _timed_step(pipeline, it, device)
    ratios, cpu_ratios = [], []
    for r in range(rounds):
        got: Dict[str, List[Tuple[float, float, int]]] = {}
        for key in (("a", "b") if r % 2 == 0 else ("b", "a")):
            pipeline, it, device, _ = runs[key]
            got[key] = [_timed_step_both(pipeline, it, device) for _ in range(block)]
            samples[key] += got[key]
        ratios.append(statistics.median(_column(got["a"], 0)) / statistics.median(_column(got["b"], 0)))
        cpu_ratios.append(statistics.median(_column(got["a"], 1)) / statistics.median(_column(got["b"], 1)))
    times, cpu, faults = ({k: _column(v, i) for k, v in samples.items()} for i in range(3))
    world = runs["a"][3]
    res = {"local_batch": batch_size, "world_size": world, "device": str(runs["a"][2]), "overrides": overrides,
           "baseline": baseline, "loader": loader, "warmup": warmup, "rounds": rounds, "block": block,
           "step_s_median": statistics.median(times["a"]), "baseline_step_s_median": statistics.median(times["b"]),
           "ratio_of_medians": statistics.median(times["a"]) / statistics.median(times["b"]),
           "round_ratio_median": statistics.median(ratios), "round_ratios": ratios,
           "round_ratio_range": [min(ratios), max(ratios)],
           "thread_cpu_s_median": statistics.median(cpu["a"]), "baseline_thread_cpu_s_median": statistics.median(cpu["b"]),
           "thread_cpu_round_ratio_median": statistics.median(cpu_ratios),
           "thread_cpu_round_ratio_range": [min(cpu_ratios), max(cpu_ratios)],
           "minor_faults_per_step_mean": statistics.fmean(faults["a"]),
           "baseline_minor_faults_per_step_mean": statistics.fmean(faults["b"])}
    log.info("B=%d %s vs %s: %.2f vs %.2f ms/step median, ratio %.3f (rounds' median %.3f, %.3f-%.3f)", batch_size,
             " ".join(overrides), " ".join(baseline), 1e3 * res["step_s_median"], 1e3 * res["baseline_step_s_median"],
             res["ratio_of_medians"], res["round_ratio_median"], min(ratios), max(ratios))
    log.info("B=%d training thread's CPU: %.2f vs %.2f ms/step median, rounds' median ratio %.3f (%.3f-%.3f)", batch_size,
             1e3 * res["thread_cpu_s_median"], 1e3 * res["baseline_thread_cpu_s_median"],
             res["thread_cpu_round_ratio_median"], min(cpu_ratios), max(cpu_ratios))
    log.info("B=%d minor page faults per step (the process, mean): %.0f vs %.0f", batch_size,
             res["minor_faults_per_step_mean"], res["baseline_minor_faults_per_step_mean"])
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[2048, 8192])
    p.add_argument("--overrides", nargs="*", default=["planner=table_wise", "pipeline=sparse_dist"])
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/gpu_step_time.json"))
    p.add_argument("--profile", action="store_true",
                   help="profile 5 more steps per batch size (torch.profiler) and 5 more (cProfile): <out stem>_B<batch>.prof.txt beside --out "
                        "(ranks above 0 under torchrun: <out stem>_B<batch>_r<rank>.prof.txt)")
    p.add_argument("--trace", action="store_true", help="with --profile: also the profiled steps' timeline "
                   "(Chrome trace, <out stem>_B<batch>.prof.trace.json.gz; _r<rank> as for --profile)")
    p.add_argument("--baseline", nargs="*", default=None,
                   help="overrides of a second configuration built in the same process: the two run interleaved "
                        "(--rounds rounds of --block steps each, ABBA), reporting --overrides over it")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--block", type=int, default=10)
    p.add_argument("--torch-ids", action="store_true",
                   help="on a CPU: the GPU's code path (torch ops, not the compiled passes over ids and rows), so "
                        "that a small batch times the host work a GPU step is bound by")
    add_loader_argument(p)
    a = p.parse_args()
    if a.torch_ids:
        use_gpu_code_path()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", force=True)
    if a.baseline is not None:
        runs = [measure_pair(b, a.overrides, a.baseline, a.warmup, a.rounds, a.block, a.loader) for b in a.batch_sizes]
    else:
        # at several ranks each rank profiles into its own files (_r<rank>), rank 0's named as at one rank
        rank = int(os.environ.get("RANK", "0"))
        rank_tag = f"_r{rank}" if rank else ""
        runs = [measure(b, a.overrides, a.warmup, a.steps,
                        a.out.with_name(f"{a.out.stem}_B{b}{rank_tag}.prof.txt") if a.profile else None, a.trace,
                        a.loader)
                for b in a.batch_sizes]
    if dist.get_rank() == 0:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps({"machine": machine(), "command": "python benchmarks/gpu_step_time.py "
                                     f"--batch-sizes {' '.join(map(str, a.batch_sizes))} --overrides "
                                     f"{' '.join(a.overrides)} --warmup {a.warmup} --loader {a.loader} " + ("--torch-ids " if a.torch_ids else "") + (
                                         f"--steps {a.steps}" if a.baseline is None else
                                         f"--baseline {' '.join(a.baseline)} --rounds {a.rounds} --block {a.block}"),
                                     "runs": runs}, indent=2))
        log.info("wrote %s", a.out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
