"""Compose the training config outside ``@hydra.main`` (tests, benchmarks, notebooks)."""

from __future__ import annotations

from typing import Sequence

from hydra import compose, initialize_config_module
from omegaconf import DictConfig


def compose_config(overrides: Sequence[str] = ()) -> DictConfig:
    """``conf/train.yaml`` with Hydra overrides applied, exactly as ``python -m torchrec_herald.train`` sees it."""
    with initialize_config_module("torchrec_herald.conf", version_base="1.3"):
        return compose("train", overrides=list(overrides))
