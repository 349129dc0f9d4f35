"""A run's stable name and checkpoint folder, derived from what it trains, so that re-running the same
command resumes it (torchx gives every launch a new app id, hence a new run dir).

The name is ``<planner>-<pipeline>-<data>-w<ranks>x<local batch>-<hash>``: the hash covers the whole
resolved config except the keys that do not change what is trained (where checkpoints go, how often
to log, whether to evaluate, the comparison run). ``run_name=...`` names the run instead.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any, Dict

from omegaconf import DictConfig, OmegaConf

__all__ = ["NOT_TRAINING_KEYS", "check_checkpoint_location", "checkpoint_dir", "run_name"]

#: top-level config keys that do not change the trained model (a re-run differing in them resumes)
NOT_TRAINING_KEYS = ("checkpoint", "log_every", "eval", "compare_with", "run_name")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


def _training_config(cfg: DictConfig) -> Dict[str, Any]:
    container = OmegaConf.to_container(cfg, resolve=True)
    assert isinstance(container, dict)
    return {k: v for k, v in container.items() if k not in NOT_TRAINING_KEYS}


def run_name(cfg: DictConfig, world_size: int) -> str:
    """``cfg.run_name`` if set (letters, digits, ``.``, ``_``, ``-``), else the name derived from the
    config and the world size. Raises ValueError naming ``run_name`` for a name that is not a folder
    name."""
    given = cfg.get("run_name")
    if given:
        if not _NAME.match(str(given)):
            raise ValueError(f"run_name={given!r} must be a folder name: letters, digits, '.', '_' and '-', "
                             f"not starting with '.' or '-'")
        return str(given)
    digest = hashlib.sha1(json.dumps(_training_config(cfg), sort_keys=True, default=str).encode()).hexdigest()[:8]
    planner = cfg.planner.name if cfg.planner.name != "stock" else f"stock_{cfg.planner.mode}"
    return f"{planner}-{cfg.pipeline.name}-{cfg.data.name}-w{int(world_size)}x{int(cfg.batch_size)}-{digest}"


def checkpoint_dir(cfg: DictConfig, world_size: int) -> Path:
    """Where the run's checkpoints live: ``checkpoint.dir`` if set, else ``checkpoint.root/<run name>``."""
    c = cfg.get("checkpoint") or {}
    if c.get("dir"):
        return Path(str(c.dir))
    return Path(str(c.get("root") or "outputs/checkpoints")) / run_name(cfg, world_size)


def check_checkpoint_location(cfg: DictConfig, world_size: int, writing: bool) -> Path:
    """Before anything trains: the checkpoint folder is a directory (or can be made one) and, when the
    run will save checkpoints (``writing``), a file can be created in it. Raises ValueError naming
    ``checkpoint.dir`` (or ``checkpoint.root``) and what is wrong; returns the folder."""
    import tempfile

    c = cfg.get("checkpoint") or {}
    key = "checkpoint.dir" if c.get("dir") else "checkpoint.root"
    given = Path(str(c.get("dir") or c.get("root") or "outputs/checkpoints"))
    folder = checkpoint_dir(cfg, world_size)
    for p in (given, *given.parents):
        if p.exists() and not p.is_dir():
            what = "is a file" if p == given else f"lies under {p}, which is a file"
            raise ValueError(f"{key}={given} {what}, not a directory; give a directory")
    if not writing:
        return folder
    existing = next(p for p in (folder, *folder.parents) if p.exists())
    try:
        fd, probe = tempfile.mkstemp(prefix=".herald-write-check-", dir=existing)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise ValueError(f"{key}={given} is not writable: no file can be created in {existing} "
                         f"({e.strerror or e}); give a writable directory") from None
    return folder
