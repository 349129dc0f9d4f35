"""Slipstream's stale-update skipping (DESIGN §3): hot rows whose values have saturated stop being trained.

Three stages, repeated every ``every`` steps so rows that wake up are trained again: (1) *snapshot* the hot
rows at the start and at the end of a measuring window of ``gap`` steps (nothing is skipped inside it,
or a frozen row could never show movement); (2) *sample*: on the upcoming inputs of the look-ahead
window, binary-search the threshold ``T ∈ [0, t_max]`` so the skipped share hits ``target ± tolerance``
(a row is stale when every coordinate moved less than ``T``); (3) *classify* inputs until the next
snapshot. Two granularities: ``input`` skips whole samples all of whose lookups are stale hot rows (no
forward, no backward, none of their rows read); ``row`` keeps every sample but excludes stale rows from
the update and from the hot-row synchronisation (their gradients are dropped), which is what cuts the
sync bytes. Opt-in and approximate: the run records its accuracy against the exact reference.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import List, Optional, Tuple

import torch

logger = logging.getLogger(__name__)

__all__ = ["GRANULARITIES", "SkipConfig", "StaleSkipper", "search_threshold"]

#: ``pipeline.skip`` values (``None``: off)
GRANULARITIES = ("input", "row")


@dataclass
class SkipConfig:
    """``pipeline.skip*`` options.

    Args:
        granularity: ``input`` or ``row``.
        target: the skipped share the threshold search aims at (inputs for ``input``, row lookups for
            ``row``), in (0, 1); Slipstream's default 0.3.
        tolerance: the accepted band around ``target``.
        start: step of the first snapshot (training before it is exact).
        gap: steps between the two snapshots of a measuring window (>= 1).
        every: steps between measuring windows (> gap).
        t_max: the largest threshold searched (Slipstream: 0.1).
    """

    granularity: str
    target: float = 0.3
    tolerance: float = 0.08
    start: int = 20
    gap: int = 10
    every: int = 100
    t_max: float = 0.1

    def __post_init__(self) -> None:
        if self.granularity not in GRANULARITIES:
            raise ValueError(f"unknown pipeline.skip {self.granularity!r}; known: {list(GRANULARITIES)} or null")
        if not 0.0 < float(self.target) < 1.0:
            raise ValueError(f"pipeline.skip_target must be in (0, 1), got {self.target}")
        if not 0.0 <= float(self.tolerance) < min(self.target, 1 - self.target):
            raise ValueError(f"pipeline.skip_tolerance must be in [0, min(target, 1 - target)), got {self.tolerance}")
        if int(self.start) < 0 or int(self.gap) < 1 or int(self.every) <= int(self.gap):
            raise ValueError(f"pipeline.skip_start >= 0, skip_gap >= 1 and skip_every > skip_gap needed; got "
                             f"start={self.start}, gap={self.gap}, every={self.every}")
        if not float(self.t_max) > 0.0:
            raise ValueError(f"pipeline.skip_t_max must be > 0, got {self.t_max}")

    def check_run_length(self, steps: Optional[int]) -> None:
        """Raise when the first measuring window does not end inside a run of ``steps`` steps."""
        if steps is not None and self.start + self.gap >= steps:
            raise ValueError(f"pipeline.skip snapshots at steps {self.start} and {self.start + self.gap} are beyond "
                             f"the run's {steps} steps; lower pipeline.skip_start / skip_gap")


def search_threshold(scores: torch.Tensor, target: float, t_max: float, iterations: int = 40) -> Tuple[float, float]:
    """Binary search of the smallest ``T ∈ [0, t_max]`` whose skipped share (``scores < T``) reaches
    ``target``; returns ``(T, share)``. The share is monotone in T; when even ``t_max`` skips less, the
    result is ``(t_max, its share)`` (the run records the share it achieved)."""
    n = scores.numel()
    if n == 0:
        return 0.0, 0.0

    def share(t: float) -> float:
        return float((scores < t).sum()) / n

    lo, hi = 0.0, float(t_max)
    if share(hi) < target:
        return hi, share(hi)
    for _ in range(iterations):
        mid = (lo + hi) / 2
        if share(mid) >= target:
            hi = mid
        else:
            lo = mid
    return hi, share(hi)


@dataclass
class StaleSkipper:
    """Per-run state of stale-update skipping (the same on every rank: snapshots are taken of flushed,
    identical hot replicas and the threshold search runs on all-gathered scores).

    ``phase(step)``: ``"snapshot_a"`` / ``"snapshot_b"`` at the ends of a measuring window, ``"measure"``
    inside one (nothing skipped), ``"skip"`` when a classification is active, ``"off"`` before the first.
    """

    config: SkipConfig
    num_hot: int
    movement: Optional[torch.Tensor] = None  # [num_hot] max |Δ| of the last measuring window
    snapshot: Optional[torch.Tensor] = None
    threshold: float = 0.0
    achieved_share: float = 0.0
    stale: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.bool))
    history: List[Tuple[int, float, float, int]] = field(default_factory=list)  # step, T, share, stale rows

    def phase(self, step: int) -> str:
        c = self.config
        if step < c.start:
            return "off"
        k, off = divmod(step - c.start, c.every)
        if off == 0:
            return "snapshot_a"
        if off == c.gap:
            return "snapshot_b"
        if off < c.gap:
            return "measure"
        return "skip" if self.stale.numel() else "off"

    def take_snapshot(self, hot_values: torch.Tensor, second: bool) -> None:
        """Record the hot rows (``[num_hot, D]``) at the start (``second=False``) or end of a window."""
        if not second:
            self.snapshot = hot_values.clone()
            self.stale = torch.empty(0, dtype=torch.bool)
            return
        assert self.snapshot is not None
        self.movement = (hot_values - self.snapshot).abs().amax(1) if self.num_hot else torch.empty(0)

    def set_threshold(self, step: int, scores: torch.Tensor) -> None:
        """Search T on the sampled ``scores`` (``input``: per sample, the largest movement among its lookups,
        ``inf`` with a cold lookup or none; ``row``: per lookup, its row's movement, ``inf`` if cold) and
        classify the hot rows."""
        assert self.movement is not None
        c = self.config
        self.threshold, self.achieved_share = search_threshold(scores, c.target, c.t_max)
        self.stale = self.movement < self.threshold
        self.history.append((step, self.threshold, self.achieved_share, int(self.stale.sum())))
        logger.info("stale-update skipping at step %d: T=%.3g, sampled skip share %.3f (target %.2f ± %.2f), "
                    "%d of %d hot rows stale", step, self.threshold, self.achieved_share, c.target, c.tolerance,
                    int(self.stale.sum()), self.num_hot)
