"""DLRM model construction: TorchRec's DLRM over an EmbeddingBagCollection, one table per sparse feature."""

from __future__ import annotations

from typing import List, Sequence

import torch
from torchrec.models.dlrm import DLRM, DLRMTrain
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection


def table_name(feature: str) -> str:
    """Name of the table that serves ``feature`` (one table per feature)."""
    return f"t_{feature}"


def build_tables(feature_names: Sequence[str], num_embeddings: Sequence[int], embedding_dim: int,
                 pooling: str = "SUM") -> List[EmbeddingBagConfig]:
    """One ``EmbeddingBagConfig`` per feature, named ``t_<feature>``."""
    if len(feature_names) != len(num_embeddings):
        raise ValueError(f"{len(feature_names)} features but {len(num_embeddings)} table sizes")
    return [
        EmbeddingBagConfig(name=table_name(f), embedding_dim=embedding_dim, num_embeddings=int(n),
                           feature_names=[f], pooling=PoolingType[pooling.upper()])
        for f, n in zip(feature_names, num_embeddings)
    ]


def build_dlrm_train(tables: List[EmbeddingBagConfig], num_dense: int, dense_arch: Sequence[int],
                     over_arch: Sequence[int], seed: int = 0, device: str = "meta") -> DLRMTrain:
    """``DLRMTrain`` (returns ``(loss, (loss, logits, labels))``) with the EBC on ``device``.

    The dense part is initialised from ``seed`` so every rank and every configuration (stock or
    herald) starts from the same weights; embedding tables are initialised by DMP (meta device) or
    explicitly by the caller.
    """
    if dense_arch[-1] != tables[0].embedding_dim:
        raise ValueError(f"model.dense_arch must end with the embedding dim {tables[0].embedding_dim}, "
                         f"got {list(dense_arch)}")
    torch.manual_seed(seed)
    ebc = EmbeddingBagCollection(tables=tables, device=torch.device(device))
    model = DLRM(embedding_bag_collection=ebc, dense_in_features=num_dense,
                 dense_arch_layer_sizes=list(dense_arch), over_arch_layer_sizes=list(over_arch),
                 dense_device=torch.device("cpu"))
    return DLRMTrain(model)
