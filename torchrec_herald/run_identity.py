"""A run's stable name and checkpoint folder, derived from what it trains, so that re-running the same
command resumes it (torchx gives every launch a new app id, hence a new run dir).

The name is ``<planner>-<pipeline>-<data>-w<ranks>x<local batch>-<hash>``: the hash covers the whole
resolved config except the keys that do not change what is trained (where checkpoints go, how often
to log, whether to evaluate, the comparison run) and those a resumed run may change (more epochs, the
eval split), so that re-running with them changed finds the run. ``run_name=...`` names the run instead.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any, Dict, Optional, Tuple, Union

from omegaconf import DictConfig, OmegaConf

__all__ = ["EVAL_SPLIT_KEYS", "MAY_CHANGE_ON_RESUME", "NOT_TRAINING_KEYS", "check_checkpoint_location", "check_folder_is_the_runs", "checkpoint_dir",
           "companion_run", "eval_identity", "exclusive_lock", "planner_name", "resume_problem", "run_name",
           "training_identity"]

#: top-level config keys that do not change the trained model (a re-run differing in them resumes)
NOT_TRAINING_KEYS = ("checkpoint", "log_every", "eval", "compare_with", "compare_turn_steps", "run_name")
#: the eval split's own keys (its files, its size): they change no trained batch
EVAL_SPLIT_KEYS = ("data.eval_paths", "data.num_eval_batches")
#: training keys a resumed run may change: more epochs train the same run on; the eval split's keys (a bad eval
#: file, fixed, is evaluated again)
MAY_CHANGE_ON_RESUME = ("epochs", *EVAL_SPLIT_KEYS)
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


def _training_config(cfg: DictConfig) -> Dict[str, Any]:
    container = OmegaConf.to_container(cfg, resolve=True)
    assert isinstance(container, dict)
    return {k: v for k, v in container.items() if k not in NOT_TRAINING_KEYS}


def _flat(d: Dict[str, Any], prefix: str = "") -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def training_identity(cfg: DictConfig, world_size: int) -> Dict[str, Any]:
    """What a checkpoint records of the run that saved it (JSON-able): the number of ranks and every key that
    changes what is trained, dotted (``optimizer.lr``), so that a resume can name what differs."""
    identity = {"world_size": int(world_size), "config": _flat(_training_config(cfg))}
    return json.loads(json.dumps(identity, default=str))  # as it reads back from trainer_state.json


def eval_identity(config: Dict[str, Any]) -> Tuple[Any, ...]:
    """What of a resolved config (a plain dict) decides its eval figures: whether it evaluates, and the eval
    split's keys."""
    flat = _flat(config)
    return (flat.get("eval", True), *(flat.get(k) for k in EVAL_SPLIT_KEYS))


def resume_problem(saved: Any, current: Dict[str, Any], path: Path) -> Optional[str]:
    """Why the checkpoint at ``path``, saved by the run ``saved`` (its :func:`training_identity`), must not
    be resumed by the run ``current``, in one line naming what differs; None where it may. A run given
    ``checkpoint.dir`` or ``run_name`` can meet another run's checkpoints there: resuming them would train
    that run on under other settings, at a data position of another batch size, and prune its
    checkpoints. Only :data:`MAY_CHANGE_ON_RESUME` may differ."""
    if not isinstance(saved, dict):
        return None  # saved before checkpoints recorded their run: nothing to compare (the caller warns)
    diffs = []
    if saved.get("world_size") != current["world_size"]:
        diffs.append(f"{current['world_size']} rank(s) here, {saved.get('world_size')} there")
    mine, theirs = current["config"], saved.get("config") or {}
    unset = "<unset>"
    # (a group's choice first, `planner.name`: the key the user changed, above the keys of the option it brings)
    for key in sorted(set(mine) | set(theirs), key=lambda k: (not k.endswith(".name"), k)):
        if key == "data.eval_paths" and key in mine and key in theirs:  # (both file sources: other eval files may be
            here, there = bool(mine[key]), bool(theirs[key])  # given, but without any every holdout_every-th training
            if here != there:                                   # batch is held out, so giving or dropping them moves
                said = {True: "given", False: "empty"}          # the trained batches)
                diffs.append(f"data.eval_paths {said[here]} here, {said[there]} there (without eval files every "
                             f"data.holdout_every-th training batch is held out, so the trained batches differ)")
            continue
        if key not in MAY_CHANGE_ON_RESUME and mine.get(key, unset) != theirs.get(key, unset):
            diffs.append(f"{key}={mine.get(key, unset)} here, {theirs.get(key, unset)} there")
    if not diffs:
        return None
    shown = "; ".join(diffs[:6]) + (f"; and {len(diffs) - 6} more" if len(diffs) > 6 else "")
    return (f"checkpoint {path} was saved by another run ({shown}): resuming it would train that run on with "
            f"these settings. Give this run a folder of its own (checkpoint.dir or run_name), or "
            f"checkpoint.resume=false to start fresh (the checkpoints there are moved aside, not deleted)")


def planner_name(cfg: DictConfig) -> str:
    """The planner a run's config names, as its run folder and progress bar say it: ``herald``, or ``stock_<mode>``
    (``stock_default``, ``stock_table_wise``, ``stock_row_wise``)."""
    return str(cfg.planner.name) if cfg.planner.name != "stock" else f"stock_{cfg.planner.mode}"


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
    named = _training_config(cfg)
    for dotted in MAY_CHANGE_ON_RESUME:  # (the same run: the name must not move with them)
        *parents, leaf = dotted.split(".")
        node: Any = named
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict):
            node.pop(leaf, None)
    digest = hashlib.sha1(json.dumps(named, sort_keys=True, default=str).encode()).hexdigest()[:8]
    return f"{planner_name(cfg)}-{cfg.pipeline.name}-{cfg.data.name}-w{int(world_size)}x{int(cfg.batch_size)}-{digest}"


def _default_root() -> str:
    """``checkpoint.root``'s default (a config composed without the group: the Python API's partial configs)."""
    from torchrec_herald.config import CheckpointConfig

    return CheckpointConfig.root


def checkpoint_dir(cfg: DictConfig, world_size: int) -> Path:
    """Where the run's checkpoints live: ``checkpoint.dir`` if set, else ``checkpoint.root/<run name>``."""
    c = cfg.get("checkpoint") or {}
    if c.get("dir"):
        return Path(str(c.dir))
    return Path(str(c.get("root") or _default_root())) / run_name(cfg, world_size)


def companion_run(cfg: DictConfig, role: str) -> None:
    """Give ``cfg``, a run trained beside another (``compare_with``'s baseline, an approximate run's exact
    reference), checkpoints of its own where the user named the folder: ``<checkpoint.dir>-<role>`` beside it
    (not inside it: ``checkpoint.resume=false`` moves the run's folder aside) or ``<run_name>-<role>``. (A
    derived name differs already: the config's hash does.) In place."""
    c = cfg.get("checkpoint")
    if c is not None and c.get("dir"):
        folder = Path(str(c.dir))
        c.dir = str(folder.with_name(f"{folder.name}-{role}"))
    if cfg.get("run_name"):
        cfg.run_name = f"{cfg.run_name}-{role}"


#: what a run writes in its checkpoint folder besides its ``step_*`` checkpoints (a finished run's figures; a save
#: in progress)
RUN_FILES = ("metrics.json", "losses.json")
#: a save in progress, another rank's write check, a figures file being written (``trainer.copy_whole``)
TEMPORARY = re.compile(r"^(\.tmp-step_\d{8,}|\.herald-write-check-.*|\.(metrics|losses)\.json\.tmp)$")


def check_folder_is_the_runs(folder: Path, key: str, given: Path) -> None:
    """The checkpoint folder holds nothing but what a run writes there (``step_*`` checkpoints, a save in progress,
    and beside checkpoints a finished run's ``metrics.json`` and ``losses.json``): a run saves into it, overwrites
    those two files at its end, and with ``checkpoint.resume=false`` moves the whole folder aside. A user's own files
    there (or another run's folder, or a Hydra run folder) would be overwritten or moved: ValueError naming them."""
    from torchrec_herald.checkpoint import STEP_DIR

    if not folder.is_dir():
        return
    entries = sorted(p.name for p in folder.iterdir())
    steps = [n for n in entries if STEP_DIR.match(n) and (folder / n).is_dir()]  # (a file of that name is not one)
    foreign = [n for n in entries if not (n in steps or TEMPORARY.match(n) or (steps and n in RUN_FILES))]
    if not foreign:
        return
    shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
    hydra = " (it is a Hydra run folder: hydra.run.dir, where the run writes its logs and metrics)" \
        if ".hydra" in foreign else ""
    where = f"{key}={given}" + ("" if folder == given else f": its run's folder {folder}")
    raise ValueError(f"{where} holds files that are not this trainer's checkpoints ({shown}){hydra}: a run "
                     f"saves there, writes metrics.json and losses.json at its end and, with checkpoint.resume=false, "
                     f"moves the folder aside. Give the checkpoints a folder of their own (new or empty)")


def check_checkpoint_location(cfg: DictConfig, world_size: int, writing: bool) -> Path:
    """Before anything trains: the checkpoint folder is a directory (or can be made one) and, when the
    run will save checkpoints (``writing``), a file can be created in it. Raises ValueError naming
    ``checkpoint.dir`` (or ``checkpoint.root``) and what is wrong; returns the folder."""
    import tempfile

    from torchrec_herald.checkpoint import STEP_DIR

    c = cfg.get("checkpoint") or {}
    key = "checkpoint.dir" if c.get("dir") else "checkpoint.root"
    given = Path(str(c.get("dir") or c.get("root") or _default_root()))
    folder = checkpoint_dir(cfg, world_size)
    for p in (given, *given.parents):
        if p.is_symlink() and not p.exists():  # (a link to a folder that is gone: saving there fails, "File exists")
            raise ValueError(f"{key}={given}{'' if p == given else f' lies under {p}, which'} is a link to "
                             f"{os.readlink(p)}, which does not exist; make that folder, or give another")
        if p.exists() and not p.is_dir():
            what = "is a file" if p == given else f"lies under {p}, which is a file"
            raise ValueError(f"{key}={given} {what}, not a directory; give a directory")
        if STEP_DIR.match(p.name) and (p / ".metadata").is_file():  # (a run would save inside a checkpoint)
            raise ValueError(f"{key}={given} is {'' if p == given else 'inside '}one checkpoint ({p.name}); "
                             f"give the folder that holds the run's checkpoints: {p.parent}")
    if not folder.name or folder.name in (".", ".."):
        raise ValueError(f"{key}={given} is not a folder of its own (the run would save into, and with "
                         f"checkpoint.resume=false move aside, {folder.resolve()}); give a named folder, e.g. "
                         f"{key}=checkpoints/<name>")
    from torchrec_herald.checkpoint import checkpoints

    moves_aside = not bool(c.get("resume", True)) and bool(checkpoints(folder))
    if writing or moves_aside:  # (it saves there, or moves it aside)
        check_folder_is_the_runs(folder, key, given)
    if moves_aside:  # (the folder is renamed in its parent)
        try:
            fd, probe = tempfile.mkstemp(prefix=".herald-write-check-", dir=folder.parent)
            os.close(fd)
            os.unlink(probe)
        except OSError as e:
            raise ValueError(f"checkpoint.resume=false would move {folder}'s checkpoints aside, but its parent "
                             f"{folder.parent} is not writable ({e.strerror or e}); give {key} a writable folder, or "
                             f"resume (checkpoint.resume=true)") from None
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


#: what :func:`exclusive_lock` gives where no lock can be taken (the file cannot be made, a file system without locks)
UNGUARDED = "unguarded"


def exclusive_lock(path: Path, what: str) -> Union[int, str]:
    """An exclusive, non-blocking ``flock`` on ``path`` (made if absent; the system drops it when the process ends),
    with who holds it written in. Returns its fd; or the holder's line (``pid … on … since …``) where another process
    holds it; or :data:`UNGUARDED` where none can be taken (one warning naming ``what``, e.g. a folder whose parent is
    not writable or a file system without locks: nothing stops another run)."""
    import errno
    import fcntl
    import logging
    import socket
    import time

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        logging.getLogger(__name__).warning("%s cannot be locked (%s cannot be made: %s): nothing stops another run "
                                            "from using it at the same time", what, path, e.strerror or e)
        return UNGUARDED
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        os.close(fd)
        if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
            logging.getLogger(__name__).warning("%s cannot be locked (%s): nothing stops another run from using it at "
                                                "the same time", what, e.strerror or e)
            return UNGUARDED
        try:
            return path.read_text(errors="replace").strip()[:200] or "another process"
        except OSError:
            return "another process"
    try:  # (who holds it, for the message a second run prints; best effort on a full disk)
        os.ftruncate(fd, 0)
        os.write(fd, f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%Y-%m-%d %H:%M:%S')}".encode())
    except OSError:
        pass
    return fd
