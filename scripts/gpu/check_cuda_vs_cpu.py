"""Herald on CUDA against herald on CPU (and stock TorchRec), same rows, batches and gradients.

Two families of cases, each trained STEPS steps on CPU and on CUDA from the same seeded weights
(tests/herald_harness.py builds the tables, data and hot sets) and compared as
``rel = max|cuda - cpu| / max|cpu|``:

* ``ebc_*`` (pass: every rel <= 1e-5): the sharded EBC alone under a loss whose gradient with respect to
  every pooled vector is a fixed, exactly representable tensor (:class:`FixedGradEmbeddings`), so both
  devices get the same gradients and only herald's embedding work differs: hot-replica lookups (fbgemm
  dense TBE) with the exact hot update, cold fused-TBE lookups and fused updates, the row-wise Adagrad
  state (EXACT_SGD and EXACT_ROWWISE_ADAGRAD), and, at two ranks, HeraldTrainPipeline's plan (pulls,
  gradient reduces, the exact update at the reducer, pushes, evictions) applied to CUDA row stores.
  Also herald on CUDA against stock TABLE_WISE on the same fixed gradients: on CUDA at one rank, on CPU
  at two (TorchRec puts stock rank r on cuda:r, so two stock ranks would need two GPUs).
* ``dlrm_*`` (reported): the whole DLRM, whose dense MLP rounds differently on CUDA (cuBLAS) and CPU,
  so the embedding gradients differ by float rounding from the first step on; next to herald's
  CUDA-vs-CPU figure stands stock TABLE_WISE's own CUDA-vs-CPU figure on the same run.

One rank runs in one process; two ranks run as two processes on the one GPU over gloo, which carries
CUDA tensors (nccl cannot put two ranks on one GPU).

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
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))  # the test harness builds the models

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import herald_harness as H  # noqa: E402
from machine_info import machine  # noqa: E402

from torchrec_herald.dist_utils import run_multiprocess  # noqa: E402

STEPS = 12
TOL = 1e-5


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max(max |b|, 1e-12) in float64 on CPU (0 for empty tensors)."""
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-12)) if b.numel() else 0.0


class FixedGradEmbeddings(torch.nn.Module):
    """The sharded EBC under ``loss = sum(pooled * G)``: the gradient of every pooled vector is ``G``,
    ``±label`` times a fixed per-column pattern of quarters (exact in float32 on any device), so CUDA
    and CPU runs feed herald's kernels the very same gradients. Returns ``(loss, (loss, pooled, labels))``
    like TorchRec's ``DLRMTrain``."""

    def __init__(self, ebc: torch.nn.Module) -> None:
        super().__init__()
        self.ebc = ebc

    def forward(self, batch: Any) -> Any:
        per_feature = self.ebc(batch.sparse_features).to_dict()  # stock TW orders its keys by rank: sort them
        pooled = torch.cat([per_feature[k] for k in sorted(per_feature)], 1)  # [B, F * D]
        pattern = ((torch.arange(pooled.shape[1], device=pooled.device) % 5) - 2).to(pooled.dtype) / 4
        g = (2 * batch.labels.to(pooled.dtype) - 1)[:, None] * pattern[None, :]
        loss = (pooled * g).sum()
        return loss, (loss.detach(), pooled.detach(), batch.labels)


def build_ebc_only(world: int, cfg: Dict[str, Any]) -> Dict[str, Any]:
    """:class:`FixedGradEmbeddings` over the harness's tables, sharded like ``H.build`` shards the DLRM."""
    from torchrec.distributed import DistributedModelParallel
    from torchrec.modules.embedding_modules import EmbeddingBagCollection
    from torchrec.optim import RowWiseAdagrad, apply_optimizer_in_backward
    from torchrec.optim.keyed import CombinedOptimizer

    from torchrec_herald.model import build_tables
    from torchrec_herald.planner.convert import herald_plan_from_row_wise
    from torchrec_herald.planner.stock import stock_plan
    from torchrec_herald.sharding import HeraldEmbeddingBagCollectionSharder

    B = cfg.get("batch_size", 32)
    data = H.make_data(cfg)
    tables = build_tables(data.feature_names, data.num_embeddings, 8, cfg.get("pooling", "SUM"))
    torch.manual_seed(0)
    model = FixedGradEmbeddings(EmbeddingBagCollection(tables, device=torch.device("cpu")))
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    lr = cfg.get("lr", 0.05)
    cls, kw = (torch.optim.SGD, {"lr": lr}) if cfg.get("optimizer", "sgd") == "sgd" else \
        (RowWiseAdagrad, {"lr": lr, "eps": 1e-8})
    apply_optimizer_in_backward(cls, model.ebc.parameters(), kw)
    sharder = HeraldEmbeddingBagCollectionSharder()
    device = torch.device(cfg.get("device", "cpu"))
    mode = "row_wise" if cfg["planner"] == "herald" else cfg["planner"]
    plan = stock_plan(model, tables, [sharder], mode, world, B, device, dist.group.WORLD)
    if cfg["planner"] == "herald":
        plan = herald_plan_from_row_wise(plan, H.hot_specs_from_data(data, tables, cfg.get("hot_min_count", 2),
                                                                     cfg.get("sync", "dense")))
    dmp = DistributedModelParallel(model, device=device, plan=plan, sharders=[sharder])
    dmp.load_state_dict(dict(initial))
    return {"dmp": dmp, "optimizer": CombinedOptimizer([dmp.fused_optimizer]), "data": data, "plan": plan,
            "batch_size": B, "device": device}


def train_case(rank: int, world: int, cfg: Dict[str, Any]) -> Dict[str, Any]:
    """One training run of ``cfg`` on this rank: losses, final weights, Adagrad state, hot ids, seconds."""
    t0 = time.perf_counter()
    b = build_ebc_only(world, cfg) if cfg.get("model") == "ebc" else H.build(world, cfg)
    losses = H.run_steps(b["dmp"], b["optimizer"], b["data"].train_batches(rank, world, b["batch_size"]),
                         cfg.get("pipeline", "plain"), b["device"])
    if cfg.get("pipeline") == "herald" or isinstance(cfg.get("pipeline"), dict):
        H.run_steps.last_pipeline.detach()  # type: ignore[attr-defined]  (flushes every cache home)
    state = H.full_state(b["dmp"])
    # (the harness's gatherer: any layout, stock TABLE_WISE's state on its one rank included)
    mom = H.full_momentum(b["dmp"]) if cfg.get("optimizer") == "rowwise_adagrad" else {}
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
    both = sorted(set(cpu["momentum"]) & set(cuda["momentum"]))
    if both:
        out["rowwise_adagrad_state"] = max(rel(cuda["momentum"][k], cpu["momentum"][k]) for k in both)
    out["hot_rows_count"] = int(sum(h.numel() for h in cpu["hot"].values()))
    return out


def global_view(per_rank: List[Dict[str, Any]]) -> Dict[str, Any]:
    """One run as a whole: per-step losses summed over ranks, rank 0's (full, replicated) weights and state."""
    losses = torch.tensor([r["losses"] for r in per_rank], dtype=torch.float64).sum(0).tolist()
    return dict(per_rank[0], losses=losses)


def _single(rank: int, world: int, cfgs: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    return [train_case(rank, world, c) for c in cfgs]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--steps", type=int, default=STEPS)
    p.add_argument("--cases", nargs="*", default=None, help="run only the cases whose names contain one of these")
    p.add_argument("--dry-run-on-cpu", action="store_true", help="CPU in place of CUDA: checks the script itself")
    a = p.parse_args()
    gpu = "cpu" if a.dry_run_on_cpu else "cuda"
    if gpu == "cuda" and not torch.cuda.is_available():
        raise SystemExit("check_cuda_vs_cpu.py needs a CUDA device (or --dry-run-on-cpu)")
    report: Dict[str, Any] = {"machine": machine(), "gpu": torch.cuda.get_device_name(0) if gpu == "cuda" else None,
                              "torch": torch.__version__, "steps": a.steps,
                              "tolerance": TOL, "cases": {}}
    ebc = {"model": "ebc", "planner": "herald"}
    cases = {
        # same gradients: one rank, herald's own per-step path (hot replicas + cold fused TBE)
        "ebc_single_sgd": (dict(ebc, optimizer="sgd", hot_min_count=2), 1),
        "ebc_single_rowwise_adagrad": (dict(ebc, optimizer="rowwise_adagrad", hot_min_count=2, batch_size=64), 1),
        "ebc_single_rowwise_adagrad_multi_hot_mean": (dict(ebc, optimizer="rowwise_adagrad", hot_min_count=2,
                                                           multi_hot=True, pooling="MEAN"), 1),
        # TrainPipelineSparseDist: the input dist on the module's worker thread (a GPU's default), its
        # kernels on the data-dist stream, joined to the compute stream by the pipeline (the DLRM: the
        # pipeline traces the model, which the EBC-only model's loss is not written for)
        "dlrm_single_rowwise_adagrad_sparse_dist": ({"planner": "herald", "optimizer": "rowwise_adagrad",
                                                     "hot_min_count": 2, "batch_size": 64, "pipeline": "sparse_dist"}, 1),
        "dlrm_per_step_rowwise_adagrad_sparse_dist_2ranks": ({"planner": "herald", "optimizer": "rowwise_adagrad",
                                                              "hot_min_count": 3, "batch_size": 64,
                                                              "pipeline": "sparse_dist"}, 2),
        # a plan replicating no rows (one rank: nothing to save): the step's hot side skipped
        "ebc_single_no_hot_rowwise_adagrad": (dict(ebc, optimizer="rowwise_adagrad", hot_min_count=10 ** 9,
                                                   batch_size=64), 1),
        # same gradients: two ranks on one GPU, HeraldTrainPipeline's plan on CUDA row stores
        "ebc_plan_sgd_2ranks": (dict(ebc, optimizer="sgd", hot_min_count=3, pipeline={"window": 2},
                                     batch_size=64), 2),
        "ebc_plan_rowwise_adagrad_2ranks": (dict(ebc, optimizer="rowwise_adagrad", hot_min_count=3,
                                                 pipeline={"window": 3, "cache_fraction": 0.02}, batch_size=64), 2),
        # HET's bounded staleness (local writes, pushes home past s updates) on CUDA row stores: against CPU
        # only (it trains differently from stock by design)
        "ebc_plan_het_s3_rowwise_adagrad_2ranks": (dict(ebc, optimizer="rowwise_adagrad", hot_min_count=3,
                                                        pipeline={"window": 3, "staleness": 3}, batch_size=64), 2),
        "ebc_per_step_rowwise_adagrad_sparse_sync_2ranks": (dict(ebc, optimizer="rowwise_adagrad", hot_min_count=3,
                                                                 sync="sparse", batch_size=64), 2),
        # the whole DLRM (dense MLP rounding differs between devices): reported next to stock's own figure
        "dlrm_single_rowwise_adagrad": ({"planner": "herald", "optimizer": "rowwise_adagrad", "hot_min_count": 2,
                                         "batch_size": 64}, 1),
        "dlrm_plan_rowwise_adagrad_2ranks": ({"planner": "herald", "optimizer": "rowwise_adagrad", "hot_min_count": 3,
                                              "pipeline": {"window": 3, "cache_fraction": 0.02}, "batch_size": 64}, 2),
    }
    if a.cases:
        cases = {n: c for n, c in cases.items() if any(f in n for f in a.cases)}
    for name, (cfg, world) in cases.items():
        cfg = dict(cfg, steps=a.steps)
        stock_cfg = dict(cfg, planner="table_wise", pipeline="plain")
        try:
            runs, stock = {}, {}
            for key, dev in (("cpu", "cpu"), ("cuda", gpu)):  # herald then stock, in one process group
                # TorchRec places stock rank r on cuda:r, so two stock ranks need two GPUs: at two ranks
                # the stock reference is stock on CPU (the exact reference of the CPU test suite)
                with_stock = key == "cpu" or world == 1
                both = run_multiprocess(_single, world, [dict(cfg, device=dev)] +
                                        ([dict(stock_cfg, device=dev)] if with_stock else []))
                runs[key] = [r[0] for r in both]
                if with_stock:
                    stock[key] = [r[1] for r in both]
            res: Dict[str, Any] = {"world_size": world, "config": dict(cfg)}
            res["cuda_vs_cpu"] = [compare(runs["cuda"][r], runs["cpu"][r]) for r in range(world)]
            res["seconds"] = {d: max(x["seconds"] for x in runs[d]) for d in runs}
            # herald vs stock: the global loss (herald's allocator trains other samples on each rank than
            # stock does) and the full weights and state (the same on every rank)
            h = {d: global_view(runs[d]) for d in runs}
            st = {d: dict(global_view(stock[d]), hot=h[d]["hot"]) for d in stock}
            ref = "cuda" if "cuda" in st else "cpu"
            res["stock_reference_device"] = gpu if ref == "cuda" else "cpu"
            res["herald_cuda_vs_stock_table_wise"] = [compare(h["cuda"], st[ref])]
            if "cuda" in st:
                res["stock_table_wise_cuda_vs_cpu"] = [compare(st["cuda"], st["cpu"])]

            def worst(cs: List[Dict[str, float]]) -> float:
                return max(v for c in cs for k, v in c.items() if k != "hot_rows_count")

            res["max_rel"] = worst(res["cuda_vs_cpu"])
            res["max_rel_herald_cuda_vs_stock"] = worst(res["herald_cuda_vs_stock_table_wise"])
            if "stock_table_wise_cuda_vs_cpu" in res:
                res["max_rel_stock_cuda_vs_cpu"] = worst(res["stock_table_wise_cuda_vs_cpu"])
            if name.startswith("ebc_"):  # same gradients on both devices: the tolerance applies
                approximate = bool(cfg.get("pipeline", {}).get("staleness"))
                res["pass"] = res["max_rel"] <= TOL and (approximate or res["max_rel_herald_cuda_vs_stock"] <= TOL)
        except Exception:
            res = {"error": traceback.format_exc()[-4000:], "pass": False}
        report["cases"][name] = res
        print(name, json.dumps({k: v for k, v in res.items() if k.startswith(("max_rel", "pass", "error"))}),
              flush=True)
        a.out.write_text(json.dumps(report, indent=2))
    report["all_pass"] = all(c.get("pass", "error" not in c) for c in report["cases"].values())
    a.out.write_text(json.dumps(report, indent=2))
    print("all_pass", report["all_pass"])


if __name__ == "__main__":
    main()
