"""``HeraldTrainPipeline`` used the way TorchRec's own pipelines are, compared with stock TorchRec on the same
batches (2 ranks): an eval pass with ``model.eval()`` between training steps (TorchRec's ``dlrm_main``
pattern) runs a forward only and reads every row's current value; training then goes on as stock. (The
reference is stock TorchRec in a plain loop: TorchRec's ``TrainPipelineSparseDist`` would evaluate the two
training batches it holds in flight before the eval loader's.)"""

from __future__ import annotations

import itertools
from typing import Any, Dict, List, Optional

import pytest
import torch

from herald_harness import LOSS_RTOL, build, weight_rtol
from torchrec_herald.dist_utils import run_multiprocess

STEPS = 12


def _train_eval_train(rank: int, world: int, cfg: Dict[str, Any], pipeline: Any, eval_steps: Optional[int] = None
                      ) -> Dict[str, List[float]]:
    """4 training steps, an eval pass over a loader of 3 batches (model.eval(), no_grad, through progress()) to
    its end or for ``eval_steps`` steps, the rest of the training iterator; the per-step losses of each part.
    ``pipeline``: herald's options, or ``plain``."""
    from torchrec.distributed.train_pipeline import TrainPipelineSparseDist

    from torchrec_herald.data import SyntheticCriteo
    from torchrec_herald.pipeline import HeraldTrainPipeline

    b = build(world, cfg)
    dmp, opt = b["dmp"], b["optimizer"]
    if pipeline in ("plain", "stock"):
        pipe = _PlainLoop(dmp, opt) if pipeline == "plain" else TrainPipelineSparseDist(dmp, opt, b["device"])
    else:
        pipe = HeraldTrainPipeline(dmp, opt, b["device"], **pipeline)
    it = b["data"].train_batches(rank, world, b["batch_size"])
    out: Dict[str, List[float]] = {"before": [], "eval": [], "after": []}
    for _ in range(4):
        out["before"].append(pipe.progress(it)[0].item())
    evals = SyntheticCriteo(scale=b["data"].scale, num_train_batches=3, seed=7).train_batches(rank, world,
                                                                                              b["batch_size"])
    dmp.eval()
    with torch.no_grad():
        for _ in itertools.count() if eval_steps is None else range(eval_steps):
            try:
                loss, logits, labels = pipe.progress(evals)  # (dlrm_main unpacks the model's output so)
            except StopIteration:
                break
            assert logits.shape == labels.shape
            out["eval"].append(loss.item())
    dmp.train()
    while True:
        try:
            out["after"].append(pipe.progress(it)[0].item())
        except StopIteration:
            break
    return out


class _PlainLoop:
    """Stock TorchRec with nothing in flight: a forward (and, training, the backward and the step) per batch."""

    def __init__(self, dmp: Any, optimizer: Any) -> None:
        self.dmp, self.optimizer = dmp, optimizer

    def progress(self, it: Any) -> Any:
        batch = next(it)
        if self.dmp.training:  # (before the forward, as TorchRec's pipelines: the fused kernels take the learning
            self.optimizer.zero_grad()  # rate it sets at the forward)
        loss, out = self.dmp(batch)
        if self.dmp.training:
            loss.backward()
            self.optimizer.step()
        return out


@pytest.mark.parametrize("options", [dict(scheduling="on"), dict(),
                                     dict(scheduling="auto", planning="by_home", probe_steps=8)],
                         ids=["scheduling_on", "defaults", "probing_scheduling_on"])
def test_an_eval_pass_between_training_steps_trains_nothing_and_reads_current_rows(options: Dict[str, Any]) -> None:
    cfg = {"planner": "herald", "optimizer": "rowwise_adagrad", "steps": STEPS, "hot_min_count": 2}
    stock_cfg = {**cfg, "planner": "table_wise"}
    herald = run_multiprocess(_train_eval_train, 2, cfg, {"window": 3, **options})
    stock = run_multiprocess(_train_eval_train, 2, stock_cfg, "plain")
    for h, s in zip(herald, stock):
        assert len(h["eval"]) == 3 and [len(h[k]) for k in ("before", "after")] == [4, STEPS - 4]
        for part in ("before", "eval", "after"):
            assert h[part] == pytest.approx(s[part], rel=LOSS_RTOL), part


@pytest.mark.parametrize("options", [dict(scheduling="off"), dict(scheduling="auto", planning="by_home",
                                                                    probe_steps=2)], ids=["off", "probing_off"])
def test_an_eval_pass_with_scheduling_off_is_torchrecs_own(options: Dict[str, Any]) -> None:
    """Scheduling off (or scheduling=auto's probe in its off phase), TorchRec's pipeline trains hot replication
    and holds two training batches in flight: they are evaluated first, then the eval loader's, exactly as
    stock ``TrainPipelineSparseDist`` does; training then goes on over the rest (in the probe, the eval used up
    two of its steps' batches and the epoch ended early)."""
    cfg = {"planner": "herald", "optimizer": "rowwise_adagrad", "steps": STEPS, "hot_min_count": 2}
    herald = run_multiprocess(_train_eval_train, 2, cfg, {"window": 3, **options})
    stock = run_multiprocess(_train_eval_train, 2, {**cfg, "planner": "table_wise"}, "stock")
    for h, s in zip(herald, stock):
        assert [len(h[k]) for k in ("before", "eval", "after")] == [4, 2 + 3, STEPS - 4 - 2]
        for part in ("before", "eval", "after"):
            assert h[part] == pytest.approx(s[part], rel=LOSS_RTOL), part


def test_an_eval_pass_stopped_early_in_the_probe_leaves_torchrecs_batches_as_stock_does() -> None:
    """An eval pass of one step while the probe's off phase holds two training batches in flight evaluates one of
    them, as stock ``TrainPipelineSparseDist`` does; the other (and the eval batch TorchRec queued behind it) then
    trains. The probe's feed gives back the one batch evaluated, not the two in flight: every training batch is
    trained or evaluated once, as stock's."""
    cfg = {"planner": "herald", "optimizer": "rowwise_adagrad", "steps": STEPS, "hot_min_count": 2}
    options = dict(window=3, scheduling="auto", planning="by_home", probe_steps=2)
    herald = run_multiprocess(_train_eval_train, 2, cfg, options, 1)
    stock = run_multiprocess(_train_eval_train, 2, {**cfg, "planner": "table_wise"}, "stock", 1)
    for h, s in zip(herald, stock):
        assert [len(h[k]) for k in ("before", "eval", "after")] == [len(s[k]) for k in ("before", "eval", "after")]
        for part in ("before", "eval", "after"):
            assert h[part] == pytest.approx(s[part], rel=LOSS_RTOL), part


def _train_with_lr_schedule(rank: int, world: int, cfg: Dict[str, Any], pipeline: Any, schedule: bool = True
                            ) -> List[float]:
    """Every step's loss, the learning rate of every param group (the fused embedding optimizer's included)
    halved every 3 steps by torch's StepLR, as a TorchRec user's scheduler does."""
    from torchrec_herald.pipeline import HeraldTrainPipeline

    b = build(world, cfg)
    dmp, opt = b["dmp"], b["optimizer"]
    pipe = _PlainLoop(dmp, opt) if pipeline == "plain" else HeraldTrainPipeline(dmp, opt, b["device"], **pipeline)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5) if schedule else None
    it = b["data"].train_batches(rank, world, b["batch_size"])
    losses = []
    while True:
        try:
            losses.append(pipe.progress(it)[0].item())
        except StopIteration:
            break
        if scheduler is not None:
            scheduler.step()
    return losses


@pytest.mark.parametrize("options", [dict(scheduling="on"), dict(scheduling="off")], ids=["scheduling_on", "off"])
def test_a_learning_rate_schedule_reaches_the_embedding_rows(options: Dict[str, Any]) -> None:
    """The fused embedding optimizer's param group carries ``lr`` (TorchRec's does): a scheduler changing it
    changes every embedding update, hot and cold rows alike, from the next step (it was ignored, and
    torch's schedulers raised KeyError 'lr')."""
    cfg = {"planner": "herald", "optimizer": "rowwise_adagrad", "steps": STEPS, "hot_min_count": 2, "lr": 0.2}
    stock_cfg = {**cfg, "planner": "table_wise"}
    herald = run_multiprocess(_train_with_lr_schedule, 2, cfg, {"window": 3, **options})
    stock = run_multiprocess(_train_with_lr_schedule, 2, stock_cfg, "plain")
    for h, s in zip(herald, stock):
        assert len(h) == STEPS and h == pytest.approx(s, rel=LOSS_RTOL)
    constant = run_multiprocess(_train_with_lr_schedule, 2, stock_cfg, "plain", False)[0]
    assert constant[-1] != pytest.approx(stock[0][-1], rel=1e-4)  # (the schedule changes the losses)


def _state_between_steps(rank: int, world: int, cfg: Dict[str, Any], pipeline: Any) -> Dict[str, Any]:
    """After 4 steps: what state_dict() and a direct forward do, then (flushed) the tables, and the losses of
    the training that goes on."""
    from herald_harness import full_state
    from torchrec_herald.pipeline import HeraldTrainPipeline

    b = build(world, cfg)
    dmp, opt = b["dmp"], b["optimizer"]
    pipe = _PlainLoop(dmp, opt) if pipeline == "plain" else HeraldTrainPipeline(dmp, opt, b["device"], **pipeline)
    it = b["data"].train_batches(rank, world, b["batch_size"])
    losses = [pipe.progress(it)[0].item() for _ in range(4)]
    refused = []
    if pipeline != "plain":
        probe = next(SyntheticCriteo_batches(b, rank, world))
        for attempt in (dmp.state_dict, lambda: dmp(probe), opt.state_dict):
            try:
                attempt()
                refused.append("none")
            except RuntimeError as e:
                refused.append(str(e))
        pipe.flush()
    tables = {k: v for k, v in full_state(dmp).items() if "embedding_bags" in k}
    while True:
        try:
            losses.append(pipe.progress(it)[0].item())
        except StopIteration:
            break
    return {"refused": refused, "tables": tables, "losses": losses}


def SyntheticCriteo_batches(b: Dict[str, Any], rank: int, world: int) -> Any:  # noqa: N802 - a data source's batches
    from torchrec_herald.data import SyntheticCriteo

    return SyntheticCriteo(scale=b["data"].scale, num_train_batches=1, seed=7).train_batches(rank, world,
                                                                                             b["batch_size"])


def test_between_steps_the_tables_are_refused_until_flushed_then_current() -> None:
    """Scheduling on, dirty rows live in caches between steps: ``state_dict()`` and a forward outside the
    pipeline would read stale tables (they did, silently). Both are refused naming the flush; after it the
    tables are stock's, and training goes on as stock."""
    cfg = {"planner": "herald", "optimizer": "rowwise_adagrad", "steps": STEPS, "hot_min_count": 2}
    herald = run_multiprocess(_state_between_steps, 2, cfg, {"window": 3, "scheduling": "on"})
    stock = run_multiprocess(_state_between_steps, 2, {**cfg, "planner": "table_wise"}, "plain")
    line = ("herald EBC: {} between two steps of Herald scheduling, whose caches hold rows newer than the tables: "
            "call HeraldTrainPipeline.flush() first (collective; training then goes on as before), or evaluate "
            "through pipeline.progress() with model.eval(), which flushes itself")
    for h, s in zip(herald, stock):
        assert h["refused"] == [line.format("state_dict()"),
                                line.format("a forward outside HeraldTrainPipeline.progress()"),
                                line.format("the fused optimizer's state (its state_dict())")]
        assert h["tables"].keys() == s["tables"].keys()
        for k in h["tables"]:
            torch.testing.assert_close(h["tables"][k], s["tables"][k], rtol=weight_rtol("rowwise_adagrad"), atol=1e-6)
        assert h["losses"] == pytest.approx(s["losses"], rel=LOSS_RTOL)


def _short_epochs(rank: int, world: int, cfg: Dict[str, Any], pipeline: Any) -> List[List[float]]:
    """Epochs of 3, 2 and 1 batches (each a new iterator), shorter than the window: every batch's loss."""
    from torchrec_herald.pipeline import HeraldTrainPipeline

    b = build(world, cfg)
    dmp, opt = b["dmp"], b["optimizer"]
    pipe = _PlainLoop(dmp, opt) if pipeline == "plain" else HeraldTrainPipeline(dmp, opt, b["device"], **pipeline)
    batches = list(b["data"].train_batches(rank, world, b["batch_size"]))
    epochs, start = [], 0
    for n in (3, 2, 1):
        it, losses = iter(batches[start: start + n]), []
        start += n
        while True:
            try:
                losses.append(pipe.progress(it)[0].item())
            except StopIteration:
                break
        epochs.append(losses)
    return epochs


def test_loaders_shorter_than_the_window_train_every_batch() -> None:
    """A short last epoch or a small loader trains like stock (it was refused: window larger than the loader)."""
    cfg = {"planner": "herald", "optimizer": "rowwise_adagrad", "steps": 6, "hot_min_count": 2}
    herald = run_multiprocess(_short_epochs, 2, cfg, {"window": 5, "scheduling": "on"})
    stock = run_multiprocess(_short_epochs, 2, {**cfg, "planner": "table_wise"}, "plain")
    for h, s in zip(herald, stock):
        assert [len(e) for e in h] == [3, 2, 1]
        assert sum(h, []) == pytest.approx(sum(s, []), rel=LOSS_RTOL)
