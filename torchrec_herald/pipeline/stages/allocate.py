"""Stage 2 of a batch entering the window: which rank trains which sample (Herald's location-aware input
allocator, docs/design.md §3). Two bodies, one per kind of batch:

* :func:`allocate_whole_batch`: every rank holds the whole global batch, scores it and assigns it alone
  (the planner's state is the same everywhere), and keeps the samples assigned to it: no collective;
* :func:`allocate_own_batch`: each rank holds its own batch; the id errors and, for a scoring allocator,
  the int16 local-lookup scores of every sample are all-gathered, every rank runs the same assignment,
  and the samples move in two all-to-alls (:func:`exchange_samples`). A sample moves only where that
  pays in time: the lookups it makes local must save more bytes than it sends (``move_penalty=null``).
"""

from __future__ import annotations

import torch
from torchrec.datasets.utils import Batch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

import torch.distributed as dist

from torchrec_herald.comm import all_to_all_rows
from torchrec_herald.pipeline.input_allocator import priced_move_penalty
from torchrec_herald.pipeline.context import (CommTimer, HeraldBatchContext, SchedulingEnv, pack_int16,
                                              select_samples, unpack_int16)
from torchrec_herald.pipeline.stages import StageHost, register_stage
from torchrec_herald.planner.hot_set import cold_lookup_bytes

__all__ = ["allocate_own_batch", "allocate_stage", "allocate_whole_batch", "exchange_samples", "sample_wire_bytes"]


@register_stage("allocate", 20)
def allocate_stage(host: StageHost, ctx: HeraldBatchContext) -> None:
    """The strategy's allocate body (whole global batch, or this rank's own batch)."""
    host.strategy.allocate(ctx)


def allocate_whole_batch(env: SchedulingEnv, ctx: HeraldBatchContext) -> None:
    """Score every sample of the global batch for every rank, assign, keep this rank's samples (in global
    order); ``ctx.rank_of`` records the assignment for the reads stage."""
    assert ctx.batch is not None and ctx.keys is not None and ctx.sample_of_key is not None
    G, W = ctx.batch.sparse_features.stride(), env.world
    if G % W:
        raise ValueError(f"pipeline.global_batches: a global batch of {G} samples does not split over {W} ranks")
    loaded_on = torch.arange(G) // (G // W)  # stock's contiguous split
    if env.allocator.needs_scores:
        scores = env.planner.local_scores(ctx.keys, ctx.sample_of_key, G)
        rank_of = env.allocator.assign_scores(scores, env.alloc_step)
        env.alloc_step += 1
        env.stats.local_lookups += int(scores.gather(1, rank_of[:, None]).sum())
        env.stats.lookups += ctx.keys.numel()
    else:
        rank_of = loaded_on
    ctx.moved = int((rank_of != loaded_on).sum())
    ctx.rank_of = rank_of
    mine = (rank_of == env.rank).nonzero().flatten()
    ctx.batch = select_samples(ctx.batch, mine)


def allocate_own_batch(env: SchedulingEnv, ctx: HeraldBatchContext) -> None:
    """(collective) Every rank's id errors and own samples' local-lookup scores are all-gathered, the
    allocator assigns the global batch, samples move to their ranks."""
    assert ctx.batch is not None
    kjt = ctx.batch.sparse_features
    B = kjt.stride()
    # scores are gathered unless the last batch's price says no sample may move (the same on every rank)
    scored = env.allocator.needs_scores and env.allocator.moves_at(env.move_penalty)
    err = torch.tensor([*ctx.bad, kjt.values().numel()], dtype=torch.int64)
    if scored and ctx.keys is not None:
        # local: a hot replica, this rank's block or a valid cache entry under the planner's state
        scores = env.planner.local_scores(ctx.keys, ctx.sample_of_key, B)
    else:
        scores = torch.zeros(B, env.world, dtype=torch.int64)
    meta = torch.cat([err, pack_int16(scores)]) if scored else err
    if env.world == 1:  # one rank: its own meta, no collective (as comm.py's exchanges at one rank)
        gathered = meta.view(1, -1)
    else:
        gathered = torch.empty(env.world * meta.numel(), dtype=torch.int64)
        with CommTimer(env.stats, "herald_schedule_meta"):
            dist.all_gather_into_tensor(gathered, meta, group=env.scheduling_group)
        gathered = gathered.view(env.world, -1)
    env.raise_on_bad(gathered[:, :3])
    nnz = int(gathered[:, 3].sum())
    if not env.allocator.needs_scores:
        return
    # a move pays only where the lookups it makes local save more bytes than the sample sends (the same
    # figures on every rank: the batch's shape and the gathered id count)
    env.move_penalty = priced_move_penalty(
        sample_wire_bytes(ctx.batch.dense_features.shape[1], len(kjt.keys()), nnz / (env.world * B)),
        cold_lookup_bytes(env.ebc.embedding_dim))
    if not scored or not env.allocator.moves_at(env.move_penalty):
        return  # no move can pay in this batch: samples stay where loaded
    all_scores = torch.cat([unpack_int16(g, B * env.world) for g in gathered[:, 4:]]).view(env.world * B, env.world)
    rank_of = env.allocator.assign_scores(all_scores, env.alloc_step, env.move_penalty)
    env.alloc_step += 1
    ctx.moved = int((rank_of != torch.arange(env.world * B) // B).sum())
    env.stats.local_lookups += int(all_scores.gather(1, rank_of[:, None]).sum())
    env.stats.lookups += nnz
    if ctx.moved:
        ctx.batch = exchange_samples(env, ctx.batch, rank_of[env.rank * B:(env.rank + 1) * B],
                                     (rank_of == env.rank).nonzero().flatten())
        ctx.keys = env.batch_keys(ctx.batch.sparse_features)


def sample_wire_bytes(num_dense: int, num_features: int, ids_per_sample: float) -> float:
    """Bytes one sample sends in :func:`exchange_samples`: dense features, label and per-feature lengths as
    32-bit words, then its ids (int32 on the wire)."""
    return 4.0 * (num_dense + 1 + num_features) + 4.0 * ids_per_sample


def _regroup(ids: torch.Tensor, bag_len: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
    """``ids`` in bags of ``bag_len``, the bags rearranged so that bag b comes ``slot[b]``-th (what a
    stable argsort of the ids by their bag's slot gives, by offsets: no sort)."""
    if ids.numel() == bag_len.numel() and bool((bag_len == 1).all()):  # one id per bag: slot is its place
        return torch.empty_like(ids).index_copy_(0, slot, ids)
    slot_len = torch.empty_like(bag_len).index_copy_(0, slot, bag_len)
    shift = (torch.cumsum(slot_len, 0) - slot_len).index_select(0, slot) - (torch.cumsum(bag_len, 0) - bag_len)
    to = torch.repeat_interleave(shift, bag_len) + torch.arange(ids.numel())
    return torch.empty_like(ids).index_copy_(0, to, ids)


def exchange_samples(env: SchedulingEnv, batch: Batch, dest: torch.Tensor, incoming: torch.Tensor) -> Batch:
    """Send each local sample to ``dest[i]`` (dense, label, per-feature lengths, ids); receive the
    samples ``incoming`` (global indices, ascending) in global order. Two all-to-alls."""
    W, B = env.world, dest.numel()
    kjt = batch.sparse_features
    F = len(kjt.keys())
    lengths = kjt.lengths().to(torch.int64).view(F, B)
    order = torch.argsort(dest, stable=True)  # samples grouped by destination, in index order
    label_shape = batch.labels.shape[1:]  # () or a multi-task model's (tasks,): carried as they are
    T = batch.labels[:1].numel() if B else 1
    fixed = torch.cat([batch.dense_features.float().view(torch.int32), batch.labels.float().reshape(B, T).view(
        torch.int32), lengths.T.to(torch.int32)], 1)  # [B, dense + T + F]
    send_counts = torch.bincount(dest, minlength=W)
    src_of_in = incoming // B
    recv_counts = torch.bincount(src_of_in, minlength=W)

    # ids sample-major in send order: bag (feature f, sample s) goes to slot (position of s in order, f)
    pos = torch.empty_like(order).index_copy_(0, order, torch.arange(B))
    slot = pos * F + torch.arange(F)[:, None]
    ids_out = _regroup(kjt.values().to(torch.int32), lengths.flatten(), slot.view(-1))
    ids_send = torch.zeros(W, dtype=torch.int64).index_add_(0, dest, lengths.sum(0)).tolist()
    with CommTimer(env.stats, "herald_samples"):
        fixed_in = all_to_all_rows(fixed[order], send_counts.tolist(), recv_counts.tolist(), env.scheduling_group,
                                   "herald_samples")
        lengths_in = fixed_in[:, -F:].to(torch.int64)  # [n_in, F], samples in ascending global order
        ids_recv = torch.zeros(W, dtype=torch.int64).index_add_(0, src_of_in, lengths_in.sum(1)).tolist()
        # ids < 2**31: int32 on the wire
        ids_in = all_to_all_rows(ids_out, ids_send, ids_recv, env.scheduling_group, "herald_samples")
    n_dense = batch.dense_features.shape[1]
    dense = fixed_in[:, :n_dense].view(torch.float32).to(batch.dense_features.dtype)
    labels = fixed_in[:, n_dense:n_dense + T].contiguous().view(torch.float32).to(batch.labels.dtype).reshape(
        -1, *label_shape)
    # back to the feature-major KJT layout: bag (sample s, feature f) goes to slot (f, s)
    n_in = lengths_in.shape[0]
    new_values = _regroup(ids_in, lengths_in.flatten(), torch.arange(F * n_in).view(F, n_in).T.reshape(-1))
    new_kjt = KeyedJaggedTensor(keys=kjt.keys(), values=new_values.to(kjt.values().dtype),
                                lengths=lengths_in.T.flatten().to(kjt.lengths().dtype))
    return Batch(dense_features=dense, sparse_features=new_kjt, labels=labels)
