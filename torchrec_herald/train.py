"""Training entry point: ``python -m torchrec_herald.train [hydra overrides]``.

Run under torchrun / torchx for several ranks (``torchrec_herald/components.py:train``); alone it
trains on one rank. Writes ``metrics.json``, ``losses.json``, ``training.png`` and per-rank logs
into the Hydra run dir and prints the metrics table on rank 0.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig
from torch.distributed.elastic.multiprocessing.errors import record

logger = logging.getLogger(__name__)


@hydra.main(version_base="1.3", config_path="conf", config_name="train")
def _hydra_main(cfg: DictConfig) -> None:
    import torch.distributed as dist

    from torchrec_herald.trainer import format_metrics_table, run_training

    run_dir = Path(HydraConfig.get().runtime.output_dir)
    # record() writes torchelastic's error file before Hydra swallows the exception, so torchrun /
    # torchx show this rank's traceback as the root cause.
    metrics = record(run_training)(cfg, run_dir)
    if dist.get_rank() == 0:
        sys.stdout.write(f"\n{format_metrics_table(metrics)}\n\nmetrics: {run_dir / 'metrics.json'}\n")
        sys.stdout.flush()
    dist.destroy_process_group()


@record  # torchelastic error file: the failing rank's traceback is shown by torchrun / torchx
def main() -> None:
    _hydra_main()


if __name__ == "__main__":
    main()
