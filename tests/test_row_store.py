"""RowStore: the hot replicas' update and their copies in the cold block (a complete ROW_WISE shard)."""

from __future__ import annotations

from typing import Any, List, Tuple

import pytest
import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType

from torchrec_herald.layout import RowLayout
from torchrec_herald.sharding.row_store import RowStore, exact_update, exact_update_where_nonzero

LR = 0.1


def store_with_two_hot_rows() -> RowStore:
    """Rank 0 of 2, one 10-row table (block: rows 0-4), hot rows 1 (in the block) and 6 (rank 1's)."""
    layout = RowLayout.build(2, {"t": 10}, {"t": torch.tensor([1, 6])})
    store = RowStore(layout, 0, 4, {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": LR,
                                    "eps": 1e-8}, torch.device("cpu"))
    with torch.no_grad():
        store.cold_weights().copy_(torch.arange(20, dtype=torch.float32).view(5, 4))
        store.hot_weights()[:2] = torch.tensor([[4.0, 5, 6, 7], [24, 25, 26, 27]])
    return store


def test_hot_update_reaches_the_block_copy_when_the_block_is_read() -> None:
    store = store_with_two_hot_rows()
    w0, s0 = store.hot_weights()[:2].clone(), store.hot_state[:2].clone()
    grad = torch.tensor([[1.0, -2, 0.5, 3], [0.25, 0, 0, 1]])
    store.update_hot_rows(torch.tensor([0, 1]), grad)
    want_w, want_s = exact_update(w0, s0, grad, EmbOptimType.EXACT_ROWWISE_ADAGRAD, LR, 1e-8)
    assert torch.equal(store.hot_weights()[:2], want_w) and torch.equal(store.hot_state[:2], want_s)
    # the copy of hot row 1 (block row 1) is written when the block is read, not at the update
    assert torch.equal(store.cold_weights()[1], torch.tensor([4.0, 5, 6, 7]))
    block, state = store.cold_block(0), store.cold_block_state(0)
    assert torch.equal(block[1], want_w[0]) and state is not None and float(state[1]) == float(want_s[0])
    # cold rows and the other rank's hot row are untouched
    assert torch.equal(block[[0, 2, 3, 4]], torch.arange(20, dtype=torch.float32).view(5, 4)[[0, 2, 3, 4]])


def test_rows_with_zero_gradient_are_not_updated() -> None:
    store = store_with_two_hot_rows()
    w0 = store.hot_weights()[:2].clone()
    store.update_hot_rows(torch.tensor([0, 1]), torch.zeros(2, 4))
    assert torch.equal(store.hot_weights()[:2], w0) and float(store.hot_state[:2].abs().sum()) == 0.0
    assert not store._mirror_stale


def test_pending_block_copies_are_one_flag_over_many_updates() -> None:
    # a run updates hot rows every step and reads the block rarely: what waits for the block must not grow,
    # and an update marks nothing on the device (one host flag)
    store = store_with_two_hot_rows()
    for step in range(200):
        store.update_hot_rows(torch.tensor([step % 2]), torch.full((1, 4), 0.01))
    assert store._mirror_stale is True
    block = store.cold_block(0)  # both rows were updated; only hot row 0 (table row 1) is in this block
    assert torch.equal(block[1], store.hot_weights()[0]) and not store._mirror_stale
    assert torch.equal(block[[0, 2, 3, 4]], torch.arange(20, dtype=torch.float32).view(5, 4)[[0, 2, 3, 4]])


@pytest.mark.parametrize("optimizer", [EmbOptimType.EXACT_SGD, EmbOptimType.EXACT_ROWWISE_ADAGRAD])
def test_a_zero_gradient_leaves_a_row_bit_identical(optimizer: EmbOptimType) -> None:
    # on a GPU every synced hot row is updated (no data-sized filter): a zero gradient must change no bit
    g = torch.Generator().manual_seed(3)
    w = torch.randn(64, 8, generator=g)
    w[0] = -0.0
    s = torch.rand(64, generator=g)
    s[1] = 0.0
    new_w, new_s = exact_update(w, s, torch.zeros(64, 8), optimizer, LR, 1e-8)
    assert torch.equal(new_w.view(torch.int32), w.view(torch.int32))
    assert torch.equal(new_s.view(torch.int32), s.view(torch.int32))


def _random_store(seed: int, optimizer: EmbOptimType, native: Any) -> RowStore:
    """Rank 1 of 3, three tables with hot rows; its own block and the hot replicas filled with distinct values.
    ``native``: True (compiled access), False (the torch reference) or ``"gpu_rows"`` (torch ops over the rows,
    each key's row found by the compiled pass: a GPU host's path where the extension is built)."""
    g = torch.Generator().manual_seed(seed)
    rows = {"a": 50, "b": 7, "c": 200}
    hot = {t: torch.randperm(n, generator=g)[: n // 5].sort().values for t, n in rows.items()}
    layout = RowLayout.build(3, rows, hot)
    store = RowStore(layout, 1, 4, {"optimizer": optimizer, "learning_rate": LR, "eps": 1e-8}, torch.device("cpu"))
    if native is not True:
        store.native = None
    if native is False:
        store.native_locate = None
    with torch.no_grad():
        store.cold_weights().copy_(torch.randn(store.cold_weights().shape, generator=g))
        store.hot_weights().copy_(torch.randn(store.hot_weights().shape, generator=g))
        if store.adagrad:
            store.cold_state().copy_(torch.rand(store.cold_state().shape, generator=g))
            store.hot_state.copy_(torch.rand(store.hot_state.shape, generator=g))
    return store


def _tracked_pair(seed: int, optimizer: EmbOptimType) -> Tuple[List[RowStore], torch.Tensor, torch.Tensor, torch.Tensor]:
    """The same random store compiled and with torch ops, bases tracked (bounded staleness), and which keys
    are hot replicas, own rows and remote rows."""
    stores = [_random_store(seed, optimizer, native) for native in (True, False)]
    n = stores[0].layout.num_rows
    hot_rows = stores[0].layout.hot_slot(torch.arange(n)) >= 0
    own_rows = stores[0].own_slot(torch.arange(n)) >= 0
    for store in stores:
        store.track_base = True
        store.rebase_hot()
    return stores, hot_rows, own_rows, torch.arange(n)[~hot_rows & ~own_rows]


@pytest.mark.parametrize("reference", [False, "gpu_rows"])
def test_compiled_row_access_reads_and_writes_like_the_torch_reference(reference: Any) -> None:
    """On the same random stores and keys (hot, own-block and remote rows; the remote ones cached by a write,
    some dropped, the cache grown), the compiled gather/scatter and the gradient update leave the same rows,
    states, cache slots and reads as the torch ops, and a row the rank does not hold is the same error."""
    import pytest

    from torchrec_herald.native import available

    assert available(), "make setup builds the extension"
    for seed, optimizer in ((0, EmbOptimType.EXACT_ROWWISE_ADAGRAD), (1, EmbOptimType.EXACT_SGD)):
        stores = [_random_store(seed, optimizer, native) for native in (True, reference)]
        assert stores[0].native is not None and stores[1].native is None
        assert (stores[1].native_locate is None) == (reference is False)
        g = torch.Generator().manual_seed(seed + 10)
        n = stores[0].layout.num_rows
        for step in range(6):
            keys = torch.randperm(n, generator=g)[: 40 + 20 * step].sort().values
            w = torch.randn(keys.numel(), 4, generator=g)
            s = torch.rand(keys.numel(), generator=g)
            for store in stores:
                store.write(keys, w, s)
                store.drop(keys[::7].contiguous())  # frees cache slots (the next writes reuse them)
            held = torch.cat([keys[torch.arange(keys.numel()) % 7 != 0], stores[0].layout.hot_keys[:5]])
            reads = [store.read(held) for store in stores]
            assert torch.equal(reads[0][0], reads[1][0]) and torch.equal(reads[0][1], reads[1][1])
            # an update of mixed rows, then of the rank's own rows alone (one kind of row: no scatter)
            own = torch.arange(n)[(stores[0].own_slot(torch.arange(n)) >= 0)
                                  & (stores[0].layout.hot_slot(torch.arange(n)) < 0)][step::3]
            for upd in (held.unique(), own):
                grad = torch.randn(upd.numel(), 4, generator=g)
                grad[::5] = 0.0
                for store in stores:
                    store.apply_gradient(upd, grad)
            assert torch.equal(stores[0].cache_map.keys, stores[1].cache_map.keys)
            assert torch.equal(stores[0].cache_map.col("slot"), stores[1].cache_map.col("slot"))
        for a, b in zip((stores[0].hot_weights(), stores[0].cold_weights(), stores[0].cache_w, stores[0].hot_state,
                         stores[0].cache_s),
                        (stores[1].hot_weights(), stores[1].cold_weights(), stores[1].cache_w, stores[1].hot_state,
                         stores[1].cache_s)):
            assert torch.equal(a, b)
        # where each key lives (masks; hot, own and cache slots where they apply), and the bounded-staleness
        # bases of the hot and cached rows, which use it
        where = [store._where(held) for store in stores]
        hot, own, cache = where[0][:3]
        assert all(torch.equal(a, b) for a, b in zip(where[0][:3], where[1][:3]))
        for i, mask in ((3, hot), (4, own), (5, cache)):
            assert torch.equal(where[0][i][mask], where[1][i][mask]) and bool((where[0][i][mask] >= 0).all())
        shared = held[hot | cache]
        for store in stores:  # (no second copy of the hot rows until bounded staleness tracks bases)
            assert store.base_hot.shape == (0, 5), store.base_hot.shape
            store.track_base = True
            store.rebase(shared)
            assert store.base_hot.shape == (store.layout.num_hot, 5)
        assert torch.equal(stores[0].base(shared), stores[1].base(shared))
        assert torch.equal(stores[0].base_hot, stores[1].base_hot) and torch.equal(stores[0].base_cache, stores[1].base_cache)
        remote = torch.tensor([int(k) for k in range(n) if int(stores[0].layout.hot_slot(torch.tensor([k]))) < 0
                               and int(stores[0].own_slot(torch.tensor([k]))) < 0
                               and not bool(stores[0].cache_map.contains(torch.tensor([k])))][:2])
        errors = []
        for store in stores:
            for access in (store.read, store._where):
                with pytest.raises(RuntimeError) as e:
                    access(torch.cat([stores[0].layout.hot_keys[:1], remote]))
                errors.append(str(e.value))
        assert errors == [f"rank 1: plan reads rows it does not hold: keys {remote.tolist()}"] * 4


def test_compiled_receive_payload_and_rebase_match_the_torch_reference() -> None:
    """Bounded staleness's row traffic on the same random stores: storing what a source sent (replacing
    rows, adding accumulated updates, new remote rows given cache slots, bases kept), the payload of a push
    (value + state, minus the base where it adds) and rebasing give the same rows, states, bases, cache
    slots and payloads compiled as with torch ops, bit for bit; a push of an own row flagged add and a row
    not held are the same errors."""
    import pytest

    from torchrec_herald.native import available

    assert available(), "make setup builds the extension"
    for seed, optimizer in ((4, EmbOptimType.EXACT_ROWWISE_ADAGRAD), (5, EmbOptimType.EXACT_SGD)):
        stores, hot_rows, own_rows, remote = _tracked_pair(seed, optimizer)
        width = 4 + (1 if stores[0].adagrad else 0)
        lay = stores[0].layout
        n = lay.num_rows
        g = torch.Generator().manual_seed(seed + 20)
        for step in range(5):
            # a pull of remote rows (new ones get slots), then pushes received: hot and own rows, some adding
            pulled = remote[torch.randperm(remote.numel(), generator=g)[:30]].sort().values
            pushed = torch.arange(n)[(hot_rows | own_rows)][torch.randperm(int((hot_rows | own_rows).sum()), generator=g)[:25]]
            pushed = pushed.sort().values
            add = torch.rand(pushed.numel(), generator=g) < 0.5
            rows_pull = torch.randn(pulled.numel(), width, generator=g).abs()
            rows_push = torch.randn(pushed.numel(), width, generator=g).abs()
            for store in stores:
                store.receive(pulled, rows_pull, torch.zeros(pulled.numel(), dtype=torch.bool))
                store.receive(pushed, rows_push, add)
                store.drop(pulled[::6].contiguous())
            held = torch.cat([pulled[torch.arange(pulled.numel()) % 6 != 0], lay.hot_keys[:7]]).sort().values
            flags = torch.rand(held.numel(), generator=g) < 0.5
            pays = [store.payload(held, flags) for store in stores]
            assert torch.equal(pays[0], pays[1]) and pays[0].shape == (held.numel(), 5)
            for store in stores:
                store.rebase(held[::2].contiguous())
            for a, b in zip((stores[0].hot_weights(), stores[0].cold_weights(), stores[0].cache_w, stores[0].hot_state,
                             stores[0].cache_s, stores[0].base_hot, stores[0].base_cache),
                            (stores[1].hot_weights(), stores[1].cold_weights(), stores[1].cache_w, stores[1].hot_state,
                             stores[1].cache_s, stores[1].base_hot, stores[1].base_cache)):
                assert torch.equal(a, b), step
            assert torch.equal(stores[0].cache_map.keys, stores[1].cache_map.keys)
            assert torch.equal(stores[0].cache_map.col("slot"), stores[1].cache_map.col("slot"))
        own = torch.arange(n)[own_rows & ~hot_rows][:2]
        errors = []
        for store in stores:
            with pytest.raises(RuntimeError) as e:
                store.payload(own, torch.ones(2, dtype=torch.bool))
            errors.append(str(e.value))
            not_held = remote[~torch.isin(remote, store.cache_map.keys)][:2]
            for access in (lambda k: store.payload(k, torch.zeros(2, dtype=torch.bool)), store.rebase):
                with pytest.raises(RuntimeError) as e:
                    access(not_held)
                errors.append(str(e.value))
        assert errors[0] == errors[3] == f"rank 1: a home never pushes its own rows (keys {own.tolist()})"
        assert errors[1] == errors[4] and errors[2] == errors[5]
        assert errors[1] == errors[2] and errors[1].startswith("rank 1: plan reads rows it does not hold: keys ")


def test_compiled_route_groups_each_ranks_sends_and_receives_as_the_torch_reference() -> None:
    """A plan's (key, src, dst) transfers on rank 1 of 3: the positions it sends grouped by destination and
    the ones it receives grouped by source (plan order within each), with their counts, compiled and with
    torch ops; a rank outside the world is named."""
    import pytest

    from torchrec_herald.sharding.plan_exec import PlanExecutor

    stores = [_random_store(6, EmbOptimType.EXACT_SGD, native) for native in (True, False)]
    execs = [PlanExecutor(store, None) for store in stores]
    g = torch.Generator().manual_seed(7)
    for n in (0, 1, 17, 300):
        t = torch.stack([torch.randint(0, 1000, (n,), generator=g), torch.randint(0, 3, (n,), generator=g),
                         torch.randint(0, 3, (n,), generator=g)], 1)
        got, want = (e._route(t) for e in execs)
        assert torch.equal(got[0], want[0]) and got[1] == want[1] and got[3] == want[3]
        assert len(got[2]) == len(want[2]) == 3 and all(torch.equal(a, b) for a, b in zip(got[2], want[2]))
        assert sum(got[1]) == int((t[:, 1] == 1).sum()) and sum(got[3]) == int((t[:, 2] == 1).sum())
    with pytest.raises(RuntimeError, match=r"plan route: transfer 1 names rank 3, outside \[0, 3\)"):
        execs[0]._route(torch.tensor([[5, 0, 1], [6, 1, 3]]))


def test_the_gpu_update_leaves_zero_gradient_rows_as_they_were_even_with_eps_zero() -> None:
    # on a GPU every synced hot row is written: a row nobody read must come out as it went in, where
    # exact_update alone gives 0 * lr / (sqrt(0) + 0) = NaN
    w = torch.tensor([[1.0, -2.0], [3.0, 4.0]])
    s = torch.tensor([0.0, 0.5])
    grad = torch.tensor([[0.0, 0.0], [0.5, -1.0]])
    naive_w, _ = exact_update(w, s, grad, EmbOptimType.EXACT_ROWWISE_ADAGRAD, LR, 0.0)
    assert bool(naive_w[0].isnan().all())
    new_w, new_s = exact_update_where_nonzero(w, s, grad, EmbOptimType.EXACT_ROWWISE_ADAGRAD, LR, 0.0)
    want_w, want_s = exact_update(w[1:], s[1:], grad[1:], EmbOptimType.EXACT_ROWWISE_ADAGRAD, LR, 0.0)
    assert torch.equal(new_w[0], w[0]) and float(new_s[0]) == 0.0
    assert torch.equal(new_w[1:], want_w) and torch.equal(new_s[1:], want_s)


def test_the_gpu_update_without_a_mask_leaves_zero_gradient_rows_as_they_were() -> None:
    """With SGD, or Adagrad with eps > 0, the GPU's update of every synced hot row makes no mask: a row whose
    gradient is zero (negative zeros included) keeps its value, its state stays as it was, and the other rows
    get exact_update's values, as the masked update gives them."""
    torch.manual_seed(0)
    w, s = torch.randn(6, 4), torch.rand(6)
    w[2] = torch.tensor([-0.0, 0.0, 1.5, -2.5])
    grad = torch.randn(6, 4)
    grad[[1, 2]] = 0.0
    grad[4] = -0.0
    zero = grad.ne(0).any(1).logical_not()
    for optimizer, eps in ((EmbOptimType.EXACT_ROWWISE_ADAGRAD, 1e-8), (EmbOptimType.EXACT_SGD, 0.0)):
        new_w, new_s = exact_update_where_nonzero(w, s, grad, optimizer, LR, eps)
        want_w, want_s = exact_update(w, s, grad, optimizer, LR, eps)
        assert torch.equal(new_w[zero], w[zero]) and torch.equal(new_s[zero], s[zero]), optimizer
        assert torch.equal(new_w[~zero], want_w[~zero]) and torch.equal(new_s[~zero], want_s[~zero]), optimizer


def test_reserving_slots_before_rows_arrive_stores_them_as_receiving_alone_does() -> None:
    """The executor gives the pulled rows not held yet their cache slots while they travel
    (``reserve``): only remote keys not cached get one, and receiving the rows afterwards leaves the very
    rows, states, cache keys and slots that receiving them alone (slots given as they are stored) does."""
    for seed, optimizer in ((0, EmbOptimType.EXACT_ROWWISE_ADAGRAD), (1, EmbOptimType.EXACT_SGD)):
        reserved, plain = (_random_store(seed, optimizer, True) for _ in range(2))
        g = torch.Generator().manual_seed(seed + 20)
        n = reserved.layout.num_rows
        for step in range(5):
            keys = torch.randperm(n, generator=g)[: 30 + 10 * step].sort().values
            rows = torch.randn(keys.numel(), 5 if reserved.adagrad else 4, generator=g).abs()
            add = torch.zeros(keys.numel(), dtype=torch.bool)
            before = reserved.cache_map.keys.clone()
            reserved.reserve(keys)
            kind, _ = reserved.native.row_store_locate(keys, *reserved._native_args())
            assert bool((kind >= 0).all())  # every key held now ...
            new = reserved.cache_map.keys[~torch.isin(reserved.cache_map.keys, before)]
            hot_or_own = (reserved.layout.hot_slot(keys) >= 0) | (reserved.own_slot(keys) >= 0)
            # ... and exactly the remote keys not cached before got a slot
            assert torch.equal(new, keys[~hot_or_own & ~torch.isin(keys, before)])
            for store in (reserved, plain):
                store.receive(keys, rows, add)
                store.drop(keys[::5].contiguous())
            assert torch.equal(reserved.cache_map.keys, plain.cache_map.keys)
            assert torch.equal(reserved.cache_map.col("slot"), plain.cache_map.col("slot"))
            held = keys[torch.arange(keys.numel()) % 5 != 0]
            assert all(torch.equal(a, b) for a, b in zip(reserved.read(held), plain.read(held)))


def test_phased_rows_stored_in_one_compiled_pass_match_the_torch_loop() -> None:
    """HET's merged all-to-all on rank 1 of 3: rows from three sources, some replacing (pulls of remote rows,
    which get cache slots) and some adding updates of three phases, several to one row. One stable sort and
    one compiled store (``_store_in_home_order``) leave the same values, states and bases as the torch
    loop (replacing rows first, then adds by phase, then by source), bit for bit."""
    from torchrec_herald.sharding.plan_exec import PlanExecutor

    for seed, optimizer in ((8, EmbOptimType.EXACT_ROWWISE_ADAGRAD), (9, EmbOptimType.EXACT_SGD)):
        stores, hot_rows, own_rows, remote = _tracked_pair(seed, optimizer)
        execs = [PlanExecutor(store, None) for store in stores]
        n = stores[0].layout.num_rows
        g = torch.Generator().manual_seed(seed + 30)
        width = 4 + (1 if stores[0].adagrad else 0)
        for step in range(4):
            pulled = remote[torch.randperm(remote.numel(), generator=g)[:20]]
            held = torch.cat([pulled, torch.arange(n)[hot_rows | own_rows]])
            entries = [(int(k), int(torch.randint(0, 3, (1,), generator=g)), False, 0) for k in pulled]
            for phase in range(3):  # each source adds to some held rows in each phase
                for src in range(3):
                    for k in held[torch.randperm(held.numel(), generator=g)[:12]]:
                        entries.append((int(k), src, True, phase))
            order = torch.randperm(len(entries), generator=g).tolist()
            entries = [entries[i] for i in order]
            keys = torch.tensor([e[0] for e in entries])
            add = torch.tensor([e[2] for e in entries])
            phase = torch.tensor([e[3] for e in entries])
            recv_pos = [torch.tensor([i for i, e in enumerate(entries) if e[1] == s], dtype=torch.int64) for s in range(3)]
            out = torch.randn(len(entries), width, generator=g)[torch.cat(recv_pos)]
            for ex in execs:
                ex._store_received(keys, add, recv_pos, out, phase)
            touched = keys.unique()
            got, want = (store.read(touched) for store in stores)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), step
            not_own = touched[stores[0].own_slot(touched) < 0]
            assert torch.equal(stores[0].base(not_own), stores[1].base(not_own)), step
            for store in stores:
                store.drop(pulled[::4].contiguous())


@pytest.mark.parametrize("case", ["exact", "key_not_planned", "planned_not_read", "empty_plan"])
def test_compiled_plan_positions_match_searchsorted_and_flag_rows_that_differ_from_the_plan(case: str) -> None:
    """``plan_positions``: each forward key's position among the plan's sorted reads (torch.searchsorted,
    clamped to the last read, so that the forward's lookups stay in range until the flag raises) and one flag, set exactly where a key is not among the reads or a read is not looked up."""
    from torchrec_herald import native

    g = torch.Generator().manual_seed(7)
    planned = torch.unique(torch.randint(0, 500, (120,), generator=g))
    keys = planned[torch.randint(0, planned.numel(), (400,), generator=g)]
    keys = torch.cat([keys, planned])[torch.randperm(400 + planned.numel(), generator=g)]  # every read looked up
    if case == "key_not_planned":
        keys[5] = 1000
    elif case == "planned_not_read":
        keys = keys[keys != planned[3]]
    elif case == "empty_plan":
        planned = planned[:0]
    pos, wrong = native.load().plan_positions(planned, keys)
    ref = torch.searchsorted(planned, keys)  # the torch path's, clamped: a key past every read stays in range
    assert torch.equal(pos, ref.clamp(max=planned.numel() - 1) if planned.numel() else ref)
    assert case != "key_not_planned" or int(pos[5]) == planned.numel() - 1
    assert wrong.dim() == 0 and bool(wrong) == (case != "exact")


def test_compiled_grouping_by_kind_of_row_matches_the_torch_ops_and_names_every_key_not_held() -> None:
    """``RowStore._slots`` (a GPU host's path where the extension is built) groups keys by kind of row in one
    compiled pass: the same (kind, positions, slots) groups as the torch ops for hot, own-block and cached keys
    mixed, for keys of one kind (positions None: the keys' own order), and for no keys; a key held nowhere
    is the same error, naming every such key."""
    from torchrec_herald.native import available

    assert available(), "make setup builds the extension"
    compiled, reference = (_random_store(3, EmbOptimType.EXACT_SGD, native) for native in ("gpu_rows", False))
    every = torch.arange(compiled.layout.num_rows)
    hot = compiled.layout.hot_slot(every) >= 0
    remote, own = every[~hot & (compiled.own_slot(every) < 0)], every[~hot & (compiled.own_slot(every) >= 0)]
    cached = remote[::2]
    for store in (compiled, reference):
        store.write(cached, torch.zeros(cached.numel(), 4), torch.zeros(cached.numel()))
    pool = torch.cat([cached[:9], compiled.layout.hot_keys[::3], own[::4]])
    mixed = pool[torch.randperm(pool.numel(), generator=torch.Generator().manual_seed(0))]
    for keys in (mixed, own[::2], compiled.layout.hot_keys[:7], cached[:5], torch.zeros(0, dtype=torch.int64)):
        got, want = compiled._slots(keys), reference._slots(keys)
        assert [(k, None if p is None else p.tolist(), s.tolist()) for k, p, s in got] == \
               [(k, None if p is None else p.tolist(), s.tolist()) for k, p, s in want]
    assert [k for k, _, _ in compiled._slots(mixed)] == [0, 1, 2]
    errors = []
    absent = remote[1::2][[0, 1, 3]]  # (never written: held nowhere)
    for store in (compiled, reference):
        with pytest.raises(RuntimeError) as e:
            store._slots(torch.cat([own[:1], absent[:2], cached[:1], absent[2:]]))
        errors.append(str(e.value))
    assert errors == [f"rank 1: plan reads rows it does not hold: keys {absent.tolist()}"] * 2


@pytest.mark.parametrize("dim", [4, 12, 16, 24, 128])
def test_the_hot_rows_adagrad_update_rounds_as_fbgemms_cpu_kernel_bit_for_bit(dim: int) -> None:
    """Herald's row-wise Adagrad update of the rows it holds (hot replicas, a plan's rows) against fbgemm's fused CPU
    kernel given the same rows, state and summed gradients. ``s + g.pow(2).mean(1)`` summed the squares in another
    order, and torch's float ``sqrt`` and ``lr / t`` (a reciprocal times lr) round otherwise: 11 states and 10,468 of
    32,000 weights differed by an ulp at dim 16, differences the steps of Adagrad then grow."""
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import PoolingMode
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        ComputeDevice, EmbeddingLocation, SplitTableBatchedEmbeddingBagsCodegen)

    torch.manual_seed(dim)
    n, lr, eps = 2000, 0.05, 1e-8
    tbe = SplitTableBatchedEmbeddingBagsCodegen([(n, dim, EmbeddingLocation.HOST, ComputeDevice.CPU)], pooling_mode=PoolingMode.SUM,
                                                optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD, learning_rate=lr, eps=eps)
    w0 = tbe.split_embedding_weights()[0].detach().clone()
    s0 = torch.rand(n) * 0.1
    tbe.split_optimizer_states()[0][0].copy_(s0)
    grad = torch.randn(n, dim) * 0.01
    tbe(torch.arange(n), torch.arange(n + 1)).backward(grad)  # one bag a row: each row's summed gradient is its own
    w, s = exact_update(w0, s0, grad, EmbOptimType.EXACT_ROWWISE_ADAGRAD, lr, eps)
    assert torch.equal(s, tbe.split_optimizer_states()[0][0])
    assert torch.equal(w, tbe.split_embedding_weights()[0])
