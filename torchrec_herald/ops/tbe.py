"""fbgemm TBE construction for herald's two storages: fused cold shards and dense hot replicas."""

from __future__ import annotations

import functools
import math
from typing import Any, Dict, Optional, Tuple

import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode
from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
    ComputeDevice,
    DenseTableBatchedEmbeddingBagsCodegen,
    SplitTableBatchedEmbeddingBagsCodegen,
)

#: embedding optimizers herald reproduces exactly on the hot replicas
SUPPORTED_OPTIMIZERS = (EmbOptimType.EXACT_SGD, EmbOptimType.EXACT_ROWWISE_ADAGRAD)

#: fbgemm's dense TBE lookup op, which :func:`dense_lookup` calls
DENSE_LOOKUP_OP = "fbgemm::dense_embedding_codegen_lookup_function"
_AUTOGRAD_LIB: Optional[torch.library.Library] = None


def register_dense_lookup_autograd() -> bool:
    """Let autograd pass through to fbgemm's own backward for :data:`DENSE_LOOKUP_OP`; True if this
    call registered it.

    fbgemm (CPU build, 1.8) registers the op for the CPU key only, and its CPU kernel records the
    gradient itself (a custom autograd function inside the kernel). PyTorch's autograd fallback then
    warns at every backward that "an autograd kernel was not registered" — on every rank, every step.
    A fallthrough kernel at the Autograd key is the registration PyTorch's warning prescribes for an op
    that handles autograd below that key: the kernel's own backward still computes the gradient
    (``tests/test_dense_lookup_autograd.py`` checks it against ``embedding_bag``'s). A build that
    already registers an Autograd kernel (fbgemm's CUDA build) is left as it is."""
    global _AUTOGRAD_LIB
    if _AUTOGRAD_LIB is not None or torch._C._dispatch_has_kernel_for_dispatch_key(DENSE_LOOKUP_OP, "Autograd"):
        return False
    lib = torch.library.Library("fbgemm", "IMPL")  # noqa: TOR901 - an impl for fbgemm's op, not a new op
    lib.impl(DENSE_LOOKUP_OP.split("::")[1], torch.library.fallthrough_kernel, "Autograd")
    _AUTOGRAD_LIB = lib  # the registration lives as long as this object
    return True


register_dense_lookup_autograd()


def fused_cold_tbe(rows: int, dim: int, fused_params: Dict[str, Any], device: torch.device
                   ) -> SplitTableBatchedEmbeddingBagsCodegen:
    """One-table SUM-pooling TBE over this rank's concatenated cold blocks, optimizer fused into
    backward (exactly TorchRec's fused kernel: every cold row lives on one rank only)."""
    opt = fused_params["optimizer"]
    on_cuda = device.type == "cuda"
    kwargs: Dict[str, Any] = {"optimizer": opt, "learning_rate": fused_params.get("learning_rate", 0.01)}
    if opt == EmbOptimType.EXACT_ROWWISE_ADAGRAD:
        kwargs["eps"] = fused_params.get("eps", 1e-8)
    return SplitTableBatchedEmbeddingBagsCodegen(
        embedding_specs=[(max(rows, 1), dim, EmbeddingLocation.DEVICE if on_cuda else EmbeddingLocation.HOST,
                          ComputeDevice.CUDA if on_cuda else ComputeDevice.CPU)],
        pooling_mode=PoolingMode.SUM,
        device=device,
        **kwargs,
    )


def dense_hot_tbe(rows: int, dim: int, device: torch.device) -> DenseTableBatchedEmbeddingBagsCodegen:
    """One-table SUM-pooling dense TBE holding the hot replica buffer (its weights). A batch looks up only
    the rows it reads, gathered into a leaf of their own (:func:`dense_lookup`), so autograd gives their
    gradient alone, which herald sums over ranks before applying the optimizer itself."""
    return DenseTableBatchedEmbeddingBagsCodegen(
        embedding_specs=[(max(rows, 1), dim)], pooling_mode=PoolingMode.SUM, use_cpu=device.type != "cuda")


def dense_lookup(weights: torch.Tensor, indices: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """SUM-pooled bags over the rows of ``weights`` ``[n, D]`` with fbgemm's dense TBE lookup kernel (the
    op ``DenseTableBatchedEmbeddingBagsCodegen`` runs), autograd giving ``weights``' gradient; for a
    per-step working set of rows that no persistent TBE owns."""
    n, dim = weights.shape
    dev = weights.device  # the kernel runs where the rows are; indices/offsets follow them there
    zero, d_offsets, zero_one = _lookup_constants(dev, dim)
    return torch.ops.fbgemm.dense_embedding_codegen_lookup_function(
        dev_weights=weights.reshape(-1), weights_offsets=zero, D_offsets=d_offsets, total_D=dim, max_D=dim,
        hash_size_cumsum=zero_one * n, total_hash_size_bits=int(math.log2(max(n, 1)) + 1),
        indices=indices.to(dev, torch.int64), offsets=offsets.to(dev, torch.int64),
        pooling_mode=int(PoolingMode.SUM), indice_weights=None, feature_requires_grad=None)


@functools.lru_cache(maxsize=None)
def _lookup_constants(dev: torch.device, dim: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`dense_lookup`'s fixed one-table arguments on ``dev``, made once (each step made them anew: four
    kernel launches a lookup on a GPU, whose step is the host's): the weights offset ``[0]``, ``D_offsets``
    ``[0, dim]`` and ``[0, 1]``, which times the rows gives ``hash_size_cumsum`` ``[0, n]`` in one op. The
    kernel only reads them."""
    return (torch.zeros(1, dtype=torch.int64, device=dev), torch.tensor([0, dim], dtype=torch.int32, device=dev),
            torch.tensor([0, 1], dtype=torch.int64, device=dev))
