"""Kill a 2-rank run after a checkpoint, re-run the identical command, and compare with an uninterrupted run.

    .venv/bin/python benchmarks/kill_and_rerun.py [--steps 1000 --every 200 --kill-at 500] [overrides ...]

Three torchx launches of ``torchrec_herald/components.py:train`` (as ``make run`` launches it): the
uninterrupted run (its own checkpoint root), then the same command with rank 1 SIGKILLed after step
``--kill-at`` (the job ends), then the identical command again, which resumes from the latest checkpoint.
Writes ``benchmarks/results/kill_and_rerun.json``: per launch the exit code, the resume line, steps,
steps of this attempt, bytes per step, samples/s; whether the losses and final weights are identical.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any, Dict, List

REPO = Path(__file__).resolve().parents[1]
TORCHX = Path(sys.executable).parent / "torchx"


def launch(overrides: List[str], env_extra: Dict[str, str]) -> Dict[str, Any]:
    rid = f"kill-rerun-{uuid.uuid4().hex[:8]}"
    cmd = [str(TORCHX), "run", "--log", "-s", "local_cwd", "torchrec_herald/components.py:train",
           "--nproc_per_node", "2", "--run_id", rid, *overrides]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    env.update(env_extra)
    t0 = time.monotonic()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    out: Dict[str, Any] = {"command": " ".join(cmd[1:]), "env": env_extra, "returncode": proc.returncode,
                           "wall_s": time.monotonic() - t0}
    text = proc.stdout + proc.stderr
    out["resume_line"] = next((ln.split("INFO ")[-1].split("WARNING ")[-1] for ln in text.splitlines()
                               if "resuming from checkpoint" in ln), None)
    metrics_path = REPO / "outputs" / rid / "metrics.json"
    if metrics_path.is_file():
        m = json.loads(metrics_path.read_text())
        out.update(steps=m["steps"], steps_this_attempt=m["steps_this_attempt"],
                   resumed_from_step=m["resumed_from_step"], train_time_s=m["train_time_s"],
                   samples_per_s=m["samples_per_s"], bytes_per_step=m["summary"]["bytes_per_step_all_ranks"],
                   checkpoint_dir=m["checkpoint_dir"])
        out["losses"] = json.loads((REPO / "outputs" / rid / "losses.json").read_text())
    shutil.rmtree(REPO / "outputs" / rid, ignore_errors=True)
    return out


def final_model(checkpoint_dir: str, step: int, scratch: Path) -> Dict[str, Any]:
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    target = scratch / f"{uuid.uuid4().hex}.pt"
    dcp_to_torch_save(str(Path(checkpoint_dir) / f"step_{step:08d}"), str(target))
    return torch.load(target, weights_only=False)["model"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--every", type=int, default=200)
    ap.add_argument("--kill-at", type=int, default=500)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("overrides", nargs="*", default=["planner=herald", "pipeline=herald"])
    a = ap.parse_args()
    results = [one(a) for _ in range(a.repeats)]
    ratios = sorted(r["rerun_vs_uninterrupted_samples_per_s"] for r in results)
    summary = {"command": "benchmarks/kill_and_rerun.py " + " ".join(sys.argv[1:]), "repeats": results,
               "all_same_losses": all(r["same_losses"] for r in results),
               "all_same_final_weights": all(r["same_final_weights"] for r in results),
               "rerun_vs_uninterrupted_samples_per_s": ratios,
               "rerun_vs_uninterrupted_samples_per_s_median": ratios[len(ratios) // 2],
               "rerun_vs_uninterrupted_bytes_per_step": [r["rerun_vs_uninterrupted_bytes_per_step"] for r in results]}
    out = REPO / "benchmarks" / "results" / "kill_and_rerun.json"
    out.write_text(json.dumps(summary, indent=2))
    print(json.dumps({k: v for k, v in summary.items() if k != "repeats"}, indent=2))
    print(f"rerun: {results[-1]['rerun']['resume_line']}\nwrote {out}")


def one(a: argparse.Namespace) -> Dict[str, Any]:
    """One uninterrupted run, one killed run and its identical re-run."""
    import torch

    with tempfile.TemporaryDirectory() as tmp:
        scratch = Path(tmp)
        common = a.overrides + [f"data.num_train_batches={a.steps}", f"checkpoint.every_n_steps={a.every}"]
        whole = launch(common + [f"checkpoint.root={scratch / 'whole'}"], {})
        command = common + [f"checkpoint.root={scratch / 'killed'}"]
        killed = launch(command, {"HERALD_FAULT_KILL_AT_STEP": str(a.kill_at), "HERALD_FAULT_KILL_RANK": "1"})
        rerun = launch(command, {})
        w1, w2 = (final_model(r["checkpoint_dir"], a.steps, scratch) for r in (whole, rerun))
        same_weights = set(w1) == set(w2) and all(torch.equal(w1[k], w2[k]) for k in w1)
    result = {"uninterrupted": whole, "killed": killed, "rerun": rerun,
              "same_losses": whole.get("losses") == rerun.get("losses"), "same_final_weights": same_weights,
              "rerun_vs_uninterrupted_samples_per_s": rerun["samples_per_s"] / whole["samples_per_s"],
              "rerun_vs_uninterrupted_bytes_per_step": rerun["bytes_per_step"] / whole["bytes_per_step"]}
    for r in (whole, killed, rerun):
        r.pop("losses", None)
    return result


if __name__ == "__main__":
    main()
