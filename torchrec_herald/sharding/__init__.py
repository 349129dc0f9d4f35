"""Sharders: the stock CPU-capable sharder (herald's sharding type arrives with hot-row replication)."""

from torchrec_herald.sharding.stock import CpuEmbeddingBagCollectionSharder

__all__ = ["CpuEmbeddingBagCollectionSharder"]
