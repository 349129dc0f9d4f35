"""Herald on CUDA against herald on CPU (and stock TorchRec on CUDA), same rows, batches and gradients.

Each case trains a herald-sharded DLRM (tests/herald_harness.py: seeded weights, hot sets from the data)
for STEPS steps on CPU and on CUDA and compares, as ``rel = max|cuda - cpu| / max|cpu|`` (pass: <= 1e-5):

* ``single``: one process, one rank (gloo carries CPU and CUDA tensors): herald's own per-step path, so
  hot-replica lookups (fbgemm dense TBE) with the exact hot update, and the cold fused TBE's lookups and
  fused updates, for EXACT_SGD and EXACT_ROWWISE_ADAGRAD; weights split into hot and cold rows, the
  row-wise Adagrad state, per-step losses; plus herald on CUDA against stock TABLE_WISE on CUDA.
* ``plan``: two processes on the one GPU over gloo (nccl cannot put two ranks on one GPU), herald with
  HeraldTrainPipeline's plan (pulls, gradient reduces, exact update at the reducer, pushes, evictions)
  applied to CUDA row stores (hot replicas, cold TBE, caches), against the same two ranks on CPU.

    PYTHONPATH=/tmp/site:$PWD python3 scripts/gpu/check_cuda_vs_cpu.py --out $OUT/gpu_check.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Dict, List

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))  # the test harness builds the models

import herald_harness as H  # noqa: E402

from torchrec_herald.dist_utils import run_multiprocess  # noqa: E402

STEPS = 12
TOL = 1e-5


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max(max |b|, 1e-12) in float64 on CPU (0 for empty tensors)."""
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-12)) if b.numel() else 0.0


def _momentum(dmp: Any) -> Dict[str, torch.Tensor]:
    """Row-wise Adagrad state of every table, gathered to full ``[n]`` tensors (collective)."""
    st = dmp.fused_optimizer.state_dict()["state"]
    flat = {k: v for per in st.values() for k, v in per.items() if k.endswith("momentum1")}
    return H.gather_state(flat)


def train_case(rank: int, world: int, cfg: Dict[str, Any]) -> Dict[str, Any]:
    """One training run of ``cfg`` on this rank: losses, final weights, Adagrad state, hot ids, seconds."""
    t0 = time.perf_counter()
    b = H.build(world, cfg)
    losses = H.run_steps(b["dmp"], b["optimizer"], b["data"].train_batches(rank, world, b["batch_size"]),
                         cfg.get("pipeline", "plain"), b["device"])
    if cfg.get("pipeline") == "herald":
        H.run_steps.last_pipeline.detach()  # type: ignore[attr-defined]  (flushes every cache home)
    state = H.full_state(b["dmp"])
    mom = _momentum(b["dmp"]) if cfg.get("optimizer") == "rowwise_adagrad" else {}
    hot: Dict[str, torch.Tensor] = {}
    if cfg["planner"] == "herald":
        from torchrec_herald.planner import herald_tables

        hot = {t: s.hot_ids.clone() for t, s in herald_tables(b["plan"]).items()}
    return {"losses": losses, "state": state, "momentum": mom, "hot": hot, "seconds": time.perf_counter() - t0}


def compare(cuda: Dict[str, Any], cpu: Dict[str, Any]) -> Dict[str, float]:
    """rel of losses, hot-row weights, cold-row weights, dense weights and Adagrad state."""
    out = {"losses": rel(torch.tensor(cuda["losses"]), torch.tensor(cpu["losses"]))}
    hot_w, cold_w, dense_w = [], [], []
    for key, ref in cpu["state"].items():
        got = cuda["state"][key]
        table = key.split(".")[-2] if "embedding_bags" in key else None
        if table is None:
            dense_w.append(rel(got, ref))
            continue
        is_hot = torch.zeros(ref.shape[0], dtype=torch.bool)
        if table in cpu["hot"]:
            is_hot[cpu["hot"][table]] = True
        hot_w.append(rel(got[is_hot], ref[is_hot]) if bool(is_hot.any()) else 0.0)
        cold_w.append(rel(got[~is_hot], ref[~is_hot]))
    out.update(hot_rows=max(hot_w, default=0.0), cold_rows=max(cold_w, default=0.0), dense=max(dense_w, default=0.0))
    if cpu["momentum"]:
        out["rowwise_adagrad_state"] = max(rel(cuda["momentum"][k], v) for k, v in cpu["momentum"].items())
    out["hot_rows_count"] = int(sum(h.numel() for h in cpu["hot"].values()))
    return out


def _single(rank: int, world: int, cfgs: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    return [train_case(rank, world, c) for c in cfgs]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--steps", type=int, default=STEPS)
    p.add_argument("--dry-run-on-cpu", action="store_true", help="CPU in place of CUDA: checks the script itself")
    a = p.parse_args()
    gpu = "cpu" if a.dry_run_on_cpu else "cuda"
    if gpu == "cuda" and not torch.cuda.is_available():
        raise SystemExit("check_cuda_vs_cpu.py needs a CUDA device (or --dry-run-on-cpu)")
    report: Dict[str, Any] = {"gpu": torch.cuda.get_device_name(0) if gpu == "cuda" else None,
                              "torch": torch.__version__, "steps": a.steps,
                              "tolerance": TOL, "cases": {}}
    cases = {
        # one rank: herald's per-step path (hot replicas + cold fused TBE), both exact optimizers
        "single_sgd": ({"planner": "herald", "optimizer": "sgd", "hot_min_count": 2, "sync": "dense"}, 1),
        "single_rowwise_adagrad": ({"planner": "herald", "optimizer": "rowwise_adagrad", "hot_min_count": 2,
                                    "sync": "dense", "batch_size": 64}, 1),
        "single_rowwise_adagrad_multi_hot_mean": ({"planner": "herald", "optimizer": "rowwise_adagrad",
                                                   "hot_min_count": 2, "multi_hot": True, "pooling": "MEAN"}, 1),
        # two ranks on one GPU: HeraldTrainPipeline's plan on CUDA row stores
        "plan_sgd_2ranks": ({"planner": "herald", "optimizer": "sgd", "hot_min_count": 3, "pipeline": {"window": 2},
                             "batch_size": 64}, 2),
        "plan_rowwise_adagrad_2ranks": ({"planner": "herald", "optimizer": "rowwise_adagrad", "hot_min_count": 3,
                                         "pipeline": {"window": 3, "cache_fraction": 0.02}, "batch_size": 64}, 2),
        "per_step_rowwise_adagrad_sparse_sync_2ranks": ({"planner": "herald", "optimizer": "rowwise_adagrad",
                                                     "hot_min_count": 3, "sync": "sparse", "pipeline": "sparse_dist",
                                                     "batch_size": 64}, 2),
    }
    for name, (cfg, world) in cases.items():
        cfg = dict(cfg, steps=a.steps)
        try:
            runs = {}
            for key, dev in (("cpu", "cpu"), ("cuda", gpu)):
                runs[key] = run_multiprocess(_single, world, [dict(cfg, device=dev)])  # per rank: [result]
            res: Dict[str, Any] = {"world_size": world, "config": {k: v for k, v in cfg.items()}}
            res["cuda_vs_cpu"] = [compare(runs["cuda"][r][0], runs["cpu"][r][0]) for r in range(world)]
            res["seconds"] = {d: max(x[0]["seconds"] for x in runs[d]) for d in runs}
            if world == 1:  # herald on CUDA vs stock TABLE_WISE on CUDA (exactness on the GPU itself)
                stock = run_multiprocess(_single, 1, [dict(cfg, planner="table_wise", device=gpu,
                                                           pipeline="plain")])[0][0]
                stock["hot"] = runs["cpu"][0][0]["hot"]
                res["herald_cuda_vs_stock_table_wise_cuda"] = compare(runs["cuda"][0][0], stock)
            worst = max(v for c in res["cuda_vs_cpu"] for k, v in c.items() if k != "hot_rows_count")
            res["max_rel"] = worst
            res["pass"] = worst <= TOL
        except Exception:
            res = {"error": traceback.format_exc()[-4000:], "pass": False}
        report["cases"][name] = res
        print(name, json.dumps({k: v for k, v in res.items() if k != "config"})[:2000], flush=True)
        a.out.write_text(json.dumps(report, indent=2))
    report["all_pass"] = all(c.get("pass") for c in report["cases"].values())
    a.out.write_text(json.dumps(report, indent=2))
    print("all_pass", report["all_pass"])


if __name__ == "__main__":
    main()
