"""What a training run measured, assembled into ``metrics.json``: throughput over this attempt's steps and
time, the step-time breakdown, traffic per step by collective and by tag, the plan and its decision,
herald's predicted vs measured traffic, the pipeline's own figures, held-out AUC/logloss, memory, and
an approximate mode's accuracy against its exact reference."""

from __future__ import annotations

import json
import logging
import resource
from typing import Any, Dict, Iterator, List, Optional

import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf
from torch import nn

from torchrec_herald.dist_utils import comm_unseen_by_host
from torchrec_herald.data.base import PADDED_LABEL
from torchrec_herald.report import embedding_bytes_per_step, headline, last_steps_window, strict_json

logger = logging.getLogger(__name__)

__all__ = ["collect_metrics", "evaluate", "herald_traffic_report", "peak_rss_mib_by_rank", "percentiles", "strict_json",
           "step_time_breakdown"]


def percentiles(xs: List[float]) -> Dict[str, float]:
    """Mean, p50, p90 and p99 of ``xs`` (empty dict for none)."""
    if not xs:
        return {}
    t = torch.tensor(xs, dtype=torch.float64)
    q = torch.quantile(t, torch.tensor([0.5, 0.9, 0.99], dtype=torch.float64))
    return {"mean": t.mean().item(), "p50": q[0].item(), "p90": q[1].item(), "p99": q[2].item()}


def step_time_breakdown(step_s: float, wait_s: float, scheduler_critical_s: float = 0.0,
                        scheduler_overlapped_s: float = 0.0) -> Dict[str, float]:
    """Where a rank's step wall time goes (all arguments per step, seconds), ms: ``comm_wait`` (blocked in
    collectives: sync calls and the ``wait()`` of async ones; DDP's all-reduce is awaited in autograd's
    C++ and counts as compute), ``scheduler_critical`` (herald scheduling on the critical path, its
    collectives excluded), ``compute`` (the rest), and ``scheduler_overlapped`` (scheduling the run-ahead
    thread did while steps trained: not part of the step)."""
    return {"step": 1e3 * step_s, "compute": 1e3 * (step_s - wait_s - scheduler_critical_s),
            "comm_wait": 1e3 * wait_s, "scheduler_critical": 1e3 * scheduler_critical_s,
            "scheduler_overlapped": 1e3 * scheduler_overlapped_s}


@torch.no_grad()
def evaluate(dmp: nn.Module, batches: Iterator[Any], device: torch.device) -> Dict[str, float]:
    """AUC (torchmetrics, synced over ranks) and mean logloss on the held-out split."""
    from torchmetrics.classification import BinaryAUROC

    auroc = BinaryAUROC().to(device)
    loss_sum = torch.zeros(2, dtype=torch.float64)
    dmp.eval()
    for batch in batches:
        _, (_, logits, labels) = dmp(batch.to(device))
        logits, labels = logits.float().view(-1), labels.float().view(-1)
        real = labels != PADDED_LABEL  # (the padding of a last global batch: every rank ran it, no rank scores it)
        if not bool(real.all()):  # (a rank whose slice is all padding updates with nothing: every rank has a state
            logits, labels = logits[real], labels[real]  # for the metric's gather, which a skipped rank had not)
        auroc.update(torch.sigmoid(logits), labels.long())
        loss_sum += torch.tensor([nn.functional.binary_cross_entropy_with_logits(
            logits, labels, reduction="sum").item(), labels.numel()], dtype=torch.float64)
    dmp.train()
    dist.all_reduce(loss_sum)
    if loss_sum[1] == 0:
        if dist.get_rank() == 0:
            logger.warning("evaluation: the held-out split holds no full global batch, so AUC and logloss are NaN "
                           "(data.num_eval_batches of synthetic data; data.eval_paths / data.holdout_every of files, "
                           "against batch_size × ranks)")
        return {"auc": float("nan"), "logloss": float("nan"), "samples": 0}
    return {"auc": auroc.compute().item(), "logloss": (loss_sum[0] / loss_sum[1]).item(),
            "samples": int(loss_sum[1].item())}


def herald_traffic_report(dmp: nn.Module, plan: Any, steps: int, measured: bool = True) -> Dict[str, Any]:
    """Herald tables' traffic per step (all ranks): the planner's prediction vs what the sharded
    module counted, per table and in total (collective; empty dict for stock plans). ``measured=False``
    (HeraldTrainPipeline's plan mode, whose transfers the module's per-table counters do not see):
    prediction only."""
    from torchrec_herald.planner import herald_tables
    from torchrec_herald.sharding import ShardedHeraldEmbeddingBagCollection

    specs = herald_tables(plan)
    if not specs:
        return {}
    local: Dict[str, Dict[str, float]] = {}
    for m in dmp.modules():
        if isinstance(m, ShardedHeraldEmbeddingBagCollection):
            local.update(m.traffic_by_table())
    gathered: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, local)
    predicted = {t: s.expected.get("herald_total", float("nan")) for t, s in specs.items()}
    if not measured:
        return {"hot_rows": {t: int(s.hot_ids.numel()) for t, s in specs.items()},
                "sync": {t: s.sync for t, s in specs.items()}, "predicted_bytes_per_step": predicted,
                "predicted_total": sum(predicted.values()),
                "predicted_stock_table_wise": sum(s.expected.get("stock_table_wise", 0.0) for s in specs.values())}
    measured_t = {t: sum(sum(g[t].values()) for g in gathered) / steps for t in local}
    return {
        "hot_rows": {t: int(s.hot_ids.numel()) for t, s in specs.items()},
        "sync": {t: s.sync for t, s in specs.items()},
        "predicted_bytes_per_step": predicted,
        "measured_bytes_per_step": measured_t,
        "predicted_total": sum(predicted.values()),
        "measured_total": sum(measured_t.values()),
        "predicted_stock_table_wise": sum(s.expected.get("stock_table_wise", 0.0) for s in specs.values()),
        "measured_by_kind": {k: sum(g[t][k] for g in gathered for t in local) / steps
                             for k in ("ids", "pooled", "grads", "hot_sync")},
    }


def peak_rss_mib_by_rank() -> List[float]:
    """Every rank's peak resident memory so far in MiB (``getrusage``; collective)."""
    mine = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0], dtype=torch.float64)
    out = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(out, mine)
    return [round(float(x), 1) for x in out]


def _approximate(own: Dict[str, Any], eval_metrics: Dict[str, float],
                 reference: Optional[Dict[str, Any]], steps_per_s: float) -> Dict[str, Any]:
    """An approximate run's figures (its pipeline's ``own``) and, with its exact reference (same batches,
    same held-out split), the reference's figures and the AUC/logloss deltas. Input skipping that
    refills its batches also gets ``data_samples_per_s``: the data's samples read per second (trained or
    skipped), the rate an epoch's time follows (``samples_per_s`` counts the trained ones)."""
    if not own:
        return {}
    out = dict(own)
    if own.get("data_samples_per_step"):
        out["data_samples_per_s"] = own["data_samples_per_step"] * steps_per_s
    if reference is not None:
        ref_eval = reference["eval"]
        out["reference"] = {"eval": ref_eval, "train_logloss": reference["train_logloss"],
                            "samples_per_s": reference["samples_per_s"],
                            "bytes_per_step": reference["traffic_per_step_total"]["bytes"],
                            "embedding_bytes_per_step": embedding_bytes_per_step(reference)}
        for key in ("auc", "logloss"):  # (null without an eval pass: metrics.json stays strict JSON)
            mine, theirs = eval_metrics.get(key), ref_eval.get(key)
            out[f"{key}_delta"] = None if mine is None or theirs is None else mine - theirs
    return out


def collect_metrics(cfg: DictConfig, *, world: int, steps: int, attempt_steps: int, restored: Optional[int],
                    resumed_from: Optional[str], checkpoint_dir: Optional[str], train_time: float,
                    step_times: List[float], losses: torch.Tensor, traffic: Dict[str, Dict[str, float]],
                    traffic_tags: Dict[str, Dict[str, float]], wait_s: float, scheduler_s: Any,
                    pipeline_report: Dict[str, Any], approximate_own: Dict[str, Any], dmp: nn.Module,
                    decision: Any, plan: Dict[str, str], eval_metrics: Dict[str, float], data_stats: Dict[str, int],
                    reference: Optional[Dict[str, Any]], herald: Dict[str, Any],
                    peer_wait_ms_by_rank: Optional[List[float]] = None, peer_wait_steps: int = 0) -> Dict[str, Any]:
    """``metrics.json``'s dict (the same on every rank; collective: every rank's peak memory).

    ``steps``: trained in total; ``attempt_steps``: by this attempt, over which every per-step figure
    is taken (``traffic`` summed over ranks, ``wait_s``, ``step_times`` and ``train_time`` saw only
    them; ``scheduler_s``: the pipeline's (critical, ahead) seconds; ``pipeline_report`` and
    ``approximate_own``: its own figures); ``losses``: every step's loss, mean over ranks; ``peer_wait_ms_by_rank``: each
    rank's wait for its latest peer, ms per step, over a window of steps (``traffic.measured_peer_wait``; None: not
    measured), this rank's reported as part of its breakdown's ``comm_wait``, over ``peer_wait_steps`` steps."""
    per_step = {k: {m: v / attempt_steps for m, v in s.items()} for k, s in traffic.items()}
    window = last_steps_window(steps)
    critical_s, ahead_s = scheduler_s
    metrics: Dict[str, Any] = {
        "world_size": world,
        "local_batch_size": cfg.batch_size,
        "global_batch_size": world * cfg.batch_size,
        "steps": steps,
        "steps_this_attempt": attempt_steps,
        "resumed_from_step": restored,
        "resumed_from": resumed_from,
        "checkpoint_dir": checkpoint_dir,
        "train_time_s": train_time,
        "samples_per_s": attempt_steps * world * cfg.batch_size / train_time,
        "step_time_s": percentiles(step_times),
        "step_time_breakdown_ms": {**step_time_breakdown(train_time / attempt_steps, wait_s / attempt_steps,
                                                         critical_s / attempt_steps, ahead_s / attempt_steps),
                                   "peer_wait": None if peer_wait_ms_by_rank is None
                                   else peer_wait_ms_by_rank[dist.get_rank() if dist.is_initialized() else 0]},
        "peer_wait_ms_by_rank": peer_wait_ms_by_rank,
        # (the steps it was measured over: the attempt's 21st to 220th, where it has them)
        "peer_wait_steps": peer_wait_steps if peer_wait_ms_by_rank is not None else 0,
        # the waits are the host's: NCCL's collectives (CUDA tensors, on a GPU host) never block it, so there
        # ``comm_wait`` misses them and ``compute`` holds them
        "comm_wait_host_only": comm_unseen_by_host(),
        "train_logloss": losses[-window:].mean().item(),
        "train_logloss_first": losses[:window].mean().item(),
        "eval": eval_metrics,
        "traffic_per_step": per_step,
        "traffic_per_step_total": {m: sum(s[m] for s in per_step.values())
                                   for m in ("calls", "bytes", "embedding_vectors")},
        "traffic_per_step_by_tag": {k: {m: v / attempt_steps for m, v in s.items()} for k, s in traffic_tags.items()},
        "plan": plan,
        "link_decision": decision.link_report(),
        "dense_sync": "forward_ordered" if getattr(dmp, "dense_sync", None) is not None else "ddp",
        "herald": herald,
        "herald_pipeline": pipeline_report,
        "data_stats": data_stats,
        "peak_rss_mib_by_rank": peak_rss_mib_by_rank(),
        "approximate": _approximate(approximate_own, eval_metrics, reference, attempt_steps / train_time),
        "config": OmegaConf.to_container(cfg, resolve=True),
    }
    metrics["summary"] = headline(metrics)
    return metrics
