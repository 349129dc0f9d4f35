"""ForwardOrderedDenseSync (torchrec_herald/sharding/dense_sync.py) trains exactly what TorchRec's DDP trains.

Each case trains the same seeded DLRM on the same global batches twice in one process group, with DDP
(TorchRec's default wrapper) and with the forward-ordered dense sync, and compares every step's loss and
every final ``DMP.state_dict()`` tensor: bit-identical at 2 ranks (a + b = b + a), within
``max|a - b| / max|b| <= 1e-5`` at 3 (gloo's order of adding three ranks' gradients depends on the
bucket's size, and DDP's bucket holds every layer). The cases cover the plain loop (zero_grad after
forward), TorchRec's ``TrainPipelineSparseDist`` (zero_grad before forward) and HeraldTrainPipeline, SGD
and Adagrad, 2 and 3 ranks, stock TABLE_WISE and herald's plan.

Behaviour: after ``optimizer.step()`` every group's sum is in flight and nothing was applied; the next
forward settles them all; ``optimizer.state_dict()`` and ``DMP.state_dict()`` settle first (a checkpoint
never misses the last step); grouping follows the modules' order; a bad ``planner.dense_sync`` is refused
before training.
"""

from __future__ import annotations

import functools
from typing import Any, Dict, List, Tuple

import pytest
import torch
from torch import nn

from herald_harness import train_many
from torchrec_herald.dist_utils import run_multiprocess

RTOL = 1e-5  # 3 ranks: gloo adds the three ranks' gradients in an order that depends on the buffer's size
STEPS = 12

#: case -> (world size, harness cfg)
CASES: Dict[str, Tuple[int, Dict[str, Any]]] = {
    "w2_herald_sgd_plain": (2, {"planner": "herald", "optimizer": "sgd", "pipeline": "plain"}),
    "w2_herald_adagrad_sparse_dist": (2, {"planner": "herald", "optimizer": "rowwise_adagrad",
                                          "pipeline": "sparse_dist"}),
    "w2_herald_sgd_herald_pipeline": (2, {"planner": "herald", "optimizer": "sgd", "pipeline": "herald"}),
    "w3_table_wise_adagrad_sparse_dist": (3, {"planner": "table_wise", "optimizer": "rowwise_adagrad",
                                              "pipeline": "sparse_dist"}),
}


def _pairs(rank: int, world: int, cfgs: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    runs = train_many(rank, world, [dict(c, dense_sync=m) for c in cfgs for m in ("ddp", "forward_ordered")])
    return [{k: r[k] for k in ("losses", "state")} for r in runs] if rank == 0 else []


@functools.lru_cache(maxsize=None)
def _results(world: int) -> Dict[str, Tuple[Dict[str, Any], Dict[str, Any]]]:
    names = [n for n, (w, _) in CASES.items() if w == world]
    cfgs = [dict(CASES[n][1], steps=STEPS) for n in names]
    runs = run_multiprocess(_pairs, world, cfgs)[0]
    return {n: (runs[2 * i], runs[2 * i + 1]) for i, n in enumerate(names)}


@pytest.mark.parametrize("case", list(CASES))
def test_forward_ordered_dense_sync_trains_like_ddp(case: str) -> None:
    world = CASES[case][0]
    ddp, ordered = _results(world)[case]
    assert len(ordered["losses"]) == len(ddp["losses"]) == STEPS
    if world == 2:
        assert ordered["losses"] == ddp["losses"]
        assert all(torch.equal(ordered["state"][k], v) for k, v in ddp["state"].items())
    for step, (a, b) in enumerate(zip(ordered["losses"], ddp["losses"])):
        assert abs(a - b) <= RTOL * abs(b), f"step {step}: loss {a} vs DDP {b}"
    assert ordered["state"].keys() == ddp["state"].keys()
    for k, b in ddp["state"].items():
        a = ordered["state"][k]
        assert a.shape == b.shape, k
        assert (a - b).abs().max() <= RTOL * max(b.abs().max().item(), 1e-12), f"{k} differs from DDP's"
    assert any("over_arch" in k for k in ddp["state"]) and any("dense_arch" in k for k in ddp["state"])


def _forward_ordered_dlrm(rank: int, world: int, steps: int) -> Tuple[Any, Any, Any, Any]:
    """(DMP, its optimizer, its forward-ordered dense sync, this rank's batches: a list) of a herald DLRM."""
    from herald_harness import build

    b = build(world, {"planner": "herald", "optimizer": "rowwise_adagrad", "dense_sync": "forward_ordered",
                      "steps": steps})
    dmp = b["dmp"]
    return dmp, b["optimizer"], dmp.dense_sync, list(b["data"].train_batches(rank, world, b["batch_size"]))


def _behaviour(rank: int, world: int) -> Dict[str, Any]:
    dmp, opt, sync, data = _forward_ordered_dlrm(rank, world, 3)
    batches = iter(data)
    out: Dict[str, Any] = {"groups": len(sync.groups)}

    def step() -> None:
        loss, _ = dmp(next(batches))
        opt.zero_grad()
        loss.backward()
        opt.step()

    step()
    out["pending_after_step"] = sync.pending
    weights = {n: p.detach().clone() for n, p in dmp.named_parameters() if "over_arch" in n}
    state = dmp.state_dict()  # settles: the checkpoint holds the step just taken
    out["pending_after_state_dict"] = sync.pending
    out["state_dict_applied_the_step"] = all(not torch.equal(state[n], w) for n, w in weights.items())
    step()
    out["pending_after_second_step"] = sync.pending
    opt.state_dict()
    out["pending_after_optimizer_state_dict"] = sync.pending
    step()
    dmp(data[0])
    out["pending_after_forward"] = sync.pending
    return out


@functools.lru_cache(maxsize=None)
def _behaviour_results() -> List[Dict[str, Any]]:
    return run_multiprocess(_behaviour, 2)


def test_step_starts_every_groups_sum_and_the_next_read_settles_it() -> None:
    for r in _behaviour_results():
        n = r["groups"]
        # harness DLRM: dense_arch's two layers (1.4 KiB together), over_arch's first (22.4 KiB), its last
        assert n == 3
        assert r["pending_after_step"] == n
        assert r["pending_after_state_dict"] == 0 and r["state_dict_applied_the_step"]
        assert r["pending_after_second_step"] == n
        assert r["pending_after_optimizer_state_dict"] == 0
        assert r["pending_after_forward"] == 0


EARLY_CASES = [{"planner": "herald", "optimizer": "rowwise_adagrad", "pipeline": "sparse_dist", "steps": STEPS},
               {"planner": "herald", "optimizer": "sgd", "pipeline": "plain", "steps": STEPS}]


def _early_pairs(rank: int, world: int) -> List[Dict[str, Any]]:
    runs = train_many(rank, world, [dict(c, dense_sync=m) for c in EARLY_CASES
                                    for m in ("ddp", "forward_ordered_in_backward")])
    return [{k: r[k] for k in ("losses", "state")} for r in runs] if rank == 0 else []


def test_sums_started_inside_backward_train_like_ddp_bit_for_bit() -> None:
    """``start_in_backward`` (HET's plan sets it): each group's sum starts as soon as backward completed
    its gradients; the same averaged gradients, applied before the same reads: DDP's training, bit for bit."""
    runs = run_multiprocess(_early_pairs, 2)[0]
    for i in range(len(EARLY_CASES)):
        ddp, early = runs[2 * i], runs[2 * i + 1]
        assert len(early["losses"]) == STEPS and early["losses"] == ddp["losses"]
        assert early["state"].keys() == ddp["state"].keys()
        assert all(torch.equal(early["state"][k], v) for k, v in ddp["state"].items())


def _early_behaviour(rank: int, world: int) -> Dict[str, Any]:
    dmp, opt, sync, data = _forward_ordered_dlrm(rank, world, 4)
    sync.start_in_backward = True
    out: Dict[str, Any] = {"groups": len(sync.groups)}
    loss, _ = dmp(data[0])
    opt.zero_grad()
    out["pending_in_forward"] = sync.pending
    loss.backward()
    out["pending_after_backward"] = sync.pending  # started inside backward, before the optimizer step
    opt.step()
    out["pending_after_step"] = sync.pending
    dmp(data[1])[0].backward()
    out["pending_after_second_backward"] = sync.pending  # the next forward settled them; backward restarted them
    dmp(data[2])[0].backward()  # a second backward before the step: gradients made after the sums started
    try:
        opt.step()
        out["error"] = "no error"
    except RuntimeError as e:
        out["error"] = str(e)
    return out


def test_sums_start_inside_backward_and_a_second_backward_before_the_step_is_refused() -> None:
    for r in run_multiprocess(_early_behaviour, 2):
        n = r["groups"]
        assert n == 3 and r["pending_in_forward"] == 0
        assert r["pending_after_backward"] == n and r["pending_after_step"] == n
        assert r["pending_after_second_backward"] == n
        assert r["error"].startswith("dense parameter '") and "got a gradient after its group's sum started in " \
            "backward" in r["error"] and r["error"].endswith("use planner.dense_sync=ddp"), r["error"]


def test_groups_follow_module_order_and_merge_only_small_neighbours() -> None:
    from torchrec_herald.sharding.dense_sync import group_dense_parameters

    model = nn.Sequential(nn.Linear(13, 64), nn.Linear(64, 16), nn.Linear(367, 64), nn.Linear(64, 32),
                          nn.Linear(32, 1))
    groups = group_dense_parameters(model, dict(model.named_parameters()), group_bytes=16 * 1024)
    assert [g.names for g in groups] == [["0.weight", "0.bias", "1.weight", "1.bias"], ["2.weight", "2.bias"],
                                         ["3.weight", "3.bias", "4.weight", "4.bias"]]
    assert [g.nbytes for g in groups] == [4 * (13 * 64 + 64 + 64 * 16 + 16), 4 * (367 * 64 + 64),
                                          4 * (64 * 32 + 32 + 32 + 1)]
    with pytest.raises(ValueError, match=r"dense parameters \['stray'\] are not held by any module"):
        group_dense_parameters(model, {"stray": nn.Parameter(torch.zeros(1))})


def test_unknown_dense_sync_is_refused_naming_the_key() -> None:
    from torchrec_herald.config import compose_config, validate
    from torchrec_herald.sharding.dense_sync import dense_sync_wrapper

    def wrapper(overrides: List[str]) -> Any:
        return dense_sync_wrapper(validate(compose_config(overrides)).planner.dense_sync)

    with pytest.raises(ValueError, match=r"unknown planner.dense_sync 'bogus'; expected one of "
                                         r"\['ddp', 'forward_ordered'\]"):
        wrapper(["planner=herald", "planner.dense_sync=bogus"])
    with pytest.raises(ValueError, match=r"unknown planner.dense_sync 'bogus'"):
        dense_sync_wrapper("bogus")
    assert wrapper(["planner=stock"]) is None
    assert wrapper(["planner=herald"]) is not None


class _ReadsAnotherLayersWeight(nn.Module):
    """``first``'s weight is read outside ``first``'s forward: its forward pre-hook cannot settle it."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(4, 4)
        self.second = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(torch.nn.functional.linear(x, self.first.weight, self.first.bias))


def _shared_read(rank: int, world: int) -> str:
    from types import SimpleNamespace

    import torch.distributed as dist

    from torchrec_herald.sharding.dense_sync import ForwardOrderedDenseSync

    torch.manual_seed(0)
    dmp = SimpleNamespace(_dmp_wrapped_module=_ReadsAnotherLayersWeight())
    sync = ForwardOrderedDenseSync(group_bytes=1)
    sync.wrap(dmp, SimpleNamespace(process_group=dist.group.WORLD), torch.device("cpu"))
    opt = sync.dense_optimizer(lambda ps: torch.optim.SGD(ps, lr=0.1))
    x = torch.ones(2, 4)
    for _ in range(2):
        dmp._dmp_wrapped_module(x).sum().backward()
        try:
            opt.step()
        except RuntimeError as e:
            return str(e)
    return "no error"


def test_a_weight_read_outside_its_layer_is_refused_naming_it() -> None:
    msg = run_multiprocess(_shared_read, 1)[0]
    assert msg.startswith("dense parameter 'first.weight' was read before its last update was applied"), msg
    assert "use planner.dense_sync=ddp" in msg


def test_the_dense_layers_go_to_the_ranks_device_as_with_ddp() -> None:
    """TorchRec's DDP wrapper moves the dense layers (built on CPU) to the rank's device; so must the
    forward-ordered sync, or a CUDA rank multiplies CUDA activations by CPU weights (``meta`` stands in
    for a second device here)."""
    from types import SimpleNamespace

    from torchrec_herald.sharding.dense_sync import ForwardOrderedDenseSync

    dmp = SimpleNamespace(_dmp_wrapped_module=nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1)))
    ForwardOrderedDenseSync().wrap(dmp, SimpleNamespace(process_group=None), torch.device("meta"))
    assert {p.device.type for p in dmp._dmp_wrapped_module.parameters()} == {"meta"}


def _one_call_and_old_state(rank: int, world: int) -> Dict[str, Any]:
    from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper

    dmp, opt, sync, data = _forward_ordered_dlrm(rank, world, 4)
    batches = iter(data)
    calls: List[int] = []
    inner = sync._optim._optimizer
    step = inner.step
    inner.step = lambda *a, **k: (calls.append(1), step(*a, **k))[1]  # type: ignore[method-assign]
    loss, _ = dmp(next(batches))
    opt.zero_grad()
    loss.backward()
    opt.step()
    for pending in sync._pending:  # every sum has arrived before the next forward ...
        pending[1].wait()
    dmp(next(batches))
    out: Dict[str, Any] = {"groups": len(sync.groups), "calls_when_all_arrived": len(calls)}
    # ... so one optimizer call updated every group. A checkpoint of the layout before (one optimizer per
    # group: the same parameter names) loads into it
    def per_group(ps: Any) -> Any:
        return torch.optim.Adagrad(ps, lr=0.05)

    before = CombinedOptimizer([KeyedOptimizerWrapper(dict(zip(g.names, g.params)), per_group) for g in sync.groups])
    for g in sync.groups:
        for p in g.params:
            p.grad = torch.zeros_like(p)
    before.step()  # a zero gradient initialises the state and moves nothing
    for g in sync.groups:
        for p in g.params:
            p.grad = None
    saved = before.state_dict()
    dense = [o for _, o in opt.optimizers if hasattr(o, "_sync")][0]
    dense.load_state_dict(saved)
    now = dense.state_dict()["state"]
    out["same_keys"] = sorted(now) == sorted(saved["state"]) and len(now) == sum(len(g.params) for g in sync.groups)
    out["loaded"] = all(torch.equal(now[k]["sum"], saved["state"][k]["sum"]) for k in saved["state"])
    return out


def test_groups_whose_sums_arrived_step_in_one_call_and_old_checkpoints_load() -> None:
    for r in run_multiprocess(_one_call_and_old_state, 2):
        assert r["groups"] == 3 and r["calls_when_all_arrived"] == 1
        assert r["same_keys"] and r["loaded"]


class _SkipsItsFirstLayer(nn.Module):
    """``a`` then ``b``; ``skip`` leaves ``a`` out of a forward (its group's sum then waits for a later one)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor, skip: bool) -> torch.Tensor:
        return self.b(x if skip else self.a(x))


def _skipped_layer(rank: int, world: int) -> bool:
    from types import SimpleNamespace

    import torch.distributed as dist

    from torchrec_herald.sharding.dense_sync import ForwardOrderedDenseSync

    torch.manual_seed(0)
    ref, mine = _SkipsItsFirstLayer(), _SkipsItsFirstLayer()
    mine.load_state_dict(ref.state_dict())
    plain = torch.optim.SGD(ref.parameters(), lr=0.1)
    dmp = SimpleNamespace(_dmp_wrapped_module=mine)
    sync = ForwardOrderedDenseSync(group_bytes=1)  # a and b: one group each
    sync.wrap(dmp, SimpleNamespace(process_group=dist.group.WORLD), torch.device("cpu"))
    opt = sync.dense_optimizer(lambda ps: torch.optim.SGD(ps, lr=0.1))
    x = torch.arange(8.0).view(2, 4) / 8

    class _NotYetArrived:  # a slow link: no sum has arrived when the next forward's hooks look
        def __init__(self, work: Any) -> None:
            self.work = work

        def is_completed(self) -> bool:
            return False

        def wait(self) -> None:
            self.work.wait()

    for skip in (False, True, False, True):
        plain.zero_grad()
        ref(x, skip).sum().backward()
        plain.step()
        mine(x, skip).sum().backward()
        opt.step()  # with a skipped, its last sum is applied here: b's fresh local gradient must wait
        sync._pending = [None if p is None else (p[0], _NotYetArrived(p[1])) for p in sync._pending]
    sync.settle_all()
    return all(torch.equal(p, q) for p, q in zip(ref.parameters(), mine.parameters()))


def test_a_layer_left_out_of_a_forward_changes_nothing_the_optimizer_does() -> None:
    assert run_multiprocess(_skipped_layer, 1) == [True]
