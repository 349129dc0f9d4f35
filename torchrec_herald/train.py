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

    from hydra import compose

    from torchrec_herald.trainer import format_comparison_table

    hc = HydraConfig.get()
    run_dir = Path(hc.runtime.output_dir)
    baseline = None
    if cfg.compare_with:
        # the same job with planner=<compare_with> and TorchRec's pipeline: same data, same global
        # batches, same initial weights
        overrides = [o for o in hc.overrides.task if not o.startswith(("planner", "pipeline", "compare_with"))]
        base_cfg = compose(config_name="train", overrides=overrides + [f"planner={cfg.compare_with}"])
        base_cfg.compare_with = None
        baseline = record(run_training)(base_cfg, run_dir / f"baseline_{cfg.compare_with}")
    # record() writes torchelastic's error file before Hydra swallows the exception, so torchrun /
    # torchx show this rank's traceback as the root cause.
    metrics = record(run_training)(cfg, run_dir)
    if dist.get_rank() == 0:
        table = format_metrics_table(metrics) if baseline is None else format_comparison_table(
            {f"{cfg.compare_with} (baseline)": baseline,
             cfg.planner.name + (" + scheduling" if cfg.pipeline.name == "herald" else ""): metrics})
        sys.stdout.write(f"\n{table}\n\nmetrics: {run_dir / 'metrics.json'}\n")
        sys.stdout.flush()
    dist.destroy_process_group()


@record  # torchelastic error file: the failing rank's traceback is shown by torchrun / torchx
def main() -> None:
    _hydra_main()


if __name__ == "__main__":
    main()
