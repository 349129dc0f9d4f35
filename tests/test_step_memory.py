"""A training step leaves nothing behind: the tensors alive after many herald steps are the ones alive
after a few (the per-step path once kept every step's pooled-vector buffers through an autograd cycle),
and the block copies waiting for a flush stay one flag per hot row (``test_row_store.py``)."""

from __future__ import annotations

import gc
import weakref
from typing import Any, Dict, List

import torch

from torchrec_herald.dist_utils import run_multiprocess


def _live_tensor_bytes() -> int:
    gc.collect()
    storages: Dict[int, int] = {}
    for o in gc.get_objects():
        if type(o) in (torch.Tensor, torch.nn.Parameter) and not o.is_meta:  # plain tensors (not ShardedTensor)
            storages[o.untyped_storage().data_ptr()] = o.untyped_storage().nbytes()
    return sum(storages.values())


def _awaited_output_is_freed(rank: int, world: int) -> bool:
    import torch.distributed as dist

    from torchrec_herald.comm import await_variable_all_to_all, start_variable_all_to_all

    x = torch.randn(6 * world, 4, requires_grad=True)
    partial = x * 2
    flight = start_variable_all_to_all(partial, [6] * world, [6] * world, dist.group.WORLD)
    out = await_variable_all_to_all(partial, flight)
    out.sum().backward()
    ref = weakref.ref(out)
    del out, flight, partial
    gc.collect()
    return ref() is None and x.grad is not None and torch.equal(x.grad, torch.full_like(x, 2.0))


def test_the_awaited_all_to_all_keeps_no_reference_to_its_output() -> None:
    assert run_multiprocess(_awaited_output_is_freed, 2, timeout_s=120) == [True, True]


def _live_after_steps(rank: int, world: int) -> List[int]:
    from torchrec.distributed.train_pipeline import TrainPipelineSparseDist

    from herald_harness import build

    h = build(world, dict(planner="herald", steps=40, hot_min_count=2, batch_size=64))
    pipe = TrainPipelineSparseDist(h["dmp"], h["optimizer"], torch.device("cpu"))
    it = iter(h["data"].train_batches(rank, world, h["batch_size"]))
    live = []
    for step in range(30):
        pipe.progress(it)
        if step in (9, 29):
            live.append(_live_tensor_bytes())
    pipe.detach()
    one_step_pooled = h["batch_size"] * len(h["data"].feature_names) * 8 * 4  # [B, F * dim 8] float32
    return live + [one_step_pooled]


def test_herald_steps_hold_no_more_tensors_after_thirty_steps_than_after_ten() -> None:
    # what is in flight varies with the batches' sizes by a few hundred bytes; a step's leftovers would
    # add at least its pooled vectors (two buffers of them, 20 times, before the fix)
    for after_10, after_30, one_step_pooled in run_multiprocess(_live_after_steps, 2, timeout_s=300):
        assert abs(after_30 - after_10) < one_step_pooled / 4, (after_10, after_30)
