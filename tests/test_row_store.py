"""RowStore: the hot replicas' update and their copies in the cold block (a complete ROW_WISE shard)."""

from __future__ import annotations

import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType

from torchrec_herald.layout import RowLayout
from torchrec_herald.sharding.row_store import RowStore, exact_update

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
    assert store._mirror_pending == []
