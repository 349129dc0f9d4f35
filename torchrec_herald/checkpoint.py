"""Checkpoints the TorchRec / torchtitan way, so a run survives a lost rank: ``torch.distributed.checkpoint``
(DCP) of the model's sharded state (herald's ROW_WISE-layout blocks, stock TorchRec's shards, the dense
weights), the fused and dense optimizer state and the trainer's position. Every rank writes only its own
shards, DCP reshards on load (herald ↔ stock ROW_WISE / TABLE_WISE), saves are atomic (a temporary
directory renamed when complete) and a run resumes from the latest complete checkpoint.

Layout: ``<dir>/step_00000100/`` (DCP's files + ``.metadata`` + ``trainer_state.json``); a save in
progress is ``<dir>/.tmp-step_00000100/``.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from torchrec_herald.dist_utils import rank0_outcome, with_hosts

logger = logging.getLogger(__name__)

__all__ = ["CheckpointMismatchError", "checkpoints", "latest_checkpoint", "load_checkpoint", "save_checkpoint"]

TRAINER_STATE = "trainer_state.json"
#: a checkpoint's folder name: ``step_<8+ digits>``
STEP_DIR = re.compile(r"^step_(\d{8,})$")


class CheckpointMismatchError(ValueError):
    """A checkpoint's tables or shapes do not match the model it is loaded into."""


def first_failure(error: BaseException) -> Optional[Tuple[int, BaseException]]:
    """(rank, exception) of the lowest rank a DCP ``CheckpointException`` holds a failure of (torch keeps each
    as (exception, traceback)); None for any other error."""
    failures = getattr(error, "failures", None)
    if not isinstance(failures, dict) or not failures:
        return None
    rank, failure = sorted(failures.items())[0]
    first = failure[0] if isinstance(failure, tuple) and failure else failure
    return (rank, first) if isinstance(first, BaseException) else None


def _state(dmp: torch.nn.Module, optimizer: Any) -> Dict[str, Any]:
    return _pruned({"model": dmp.state_dict(), "optim": optimizer.state_dict()})


def _pruned(d: Any) -> Any:
    """``d`` without empty dicts, recursively (SGD's per-parameter state is ``{}``: DCP cannot save a
    key with nothing under it, and ranks of a TABLE_WISE plan would disagree on it); new dicts, the
    same leaves."""
    if not isinstance(d, dict):
        return d
    out = {k: _pruned(v) for k, v in d.items()}
    return {k: v for k, v in out.items() if not (isinstance(v, dict) and not v)}


def _merged(into: Any, loaded: Any) -> Any:
    """``into`` with the leaves of ``loaded`` (its pruned copy after loading) put back."""
    if not isinstance(into, dict) or not isinstance(loaded, dict):
        return loaded
    return {k: _merged(v, loaded[k]) if k in loaded else v for k, v in into.items()}


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def save_checkpoint(directory: Path, step: int, dmp: torch.nn.Module, optimizer: Any, trainer_state: Dict[str, Any],
                    keep: int = 2) -> Path:
    """Save (collective) into ``directory/step_<step>``: DCP writes every rank's shards into a temporary
    directory, rank 0 adds ``trainer_state.json`` and renames it; then only the ``keep`` newest remain.
    A herald model must be flushed first (``HeraldTrainPipeline.flush``): its blocks then hold every
    row's current value."""
    directory = Path(directory)
    final = directory / f"step_{step:08d}"
    tmp = directory / f".tmp-step_{step:08d}"

    def prepare() -> None:
        directory.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # a save of this step that was interrupted earlier
        tmp.mkdir()

    def publish() -> None:
        with open(tmp / TRAINER_STATE, "w") as f:
            json.dump(dict(trainer_state, step=step), f)
            f.flush()
            os.fsync(f.fileno())
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)  # atomic: a reader sees the whole checkpoint or none of it
        for left in directory.glob(".tmp-step_*"):  # (saves of other steps that a kill interrupted: their space back;
            shutil.rmtree(left, ignore_errors=True)  # the folder is this run's alone while it trains)
        complete = [p for p in checkpoints(directory) if _incomplete(p) is None]  # (never a folder it cannot read)
        for old in complete[:-max(int(keep), 1)]:
            shutil.rmtree(old, ignore_errors=True)
        logger.info("saved checkpoint %s", final)

    state = _state(dmp, optimizer)  # (its own errors are not the disk's)
    _on_rank0(prepare, f"cannot make the checkpoint folder {tmp}")
    try:
        dcp.save(state, checkpoint_id=str(tmp))
    except (Exception, CheckpointException) as e:  # (DCP's is a BaseException, raised on every rank alike)
        failed = first_failure(e)
        cause = failed[1] if failed is not None else e
        what = getattr(cause, "strerror", None) or f"{type(cause).__name__}: {cause}"
        if not getattr(cause, "strerror", None):  # (torch's writer reports a short write as "unexpected pos ...",
            try:                                  # never the disk's error: say how full the disk is, before the
                free = shutil.disk_usage(tmp if tmp.exists() else directory).free  # partial save is removed)
            except OSError:
                free = None
            if free is not None and free < FULL_DISK_BYTES:
                what += f"; its file system has {free / 2**20:.1f} MiB free: No space left on device?"
        if _rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # (a save that did not finish: its space back, e.g. a full disk)
        raise OSError(f"cannot write the checkpoint {final} ({what}; checkpoint.dir / checkpoint.root); the "
                      f"checkpoints saved before it are kept") from e
    _on_rank0(publish, f"cannot finish the checkpoint {final}")
    return final


#: free bytes under which a save's failure that names no disk error is said to be a full disk
FULL_DISK_BYTES = 64 << 20


def _on_rank0(work: Callable[[], None], what: str) -> None:
    """Run ``work`` on rank 0 and give its outcome to every rank (collective): an OSError there (a full disk, a
    folder turned read-only) raises the same line on every rank, where a barrier would leave the others waiting
    for rank 0 until the process group's timeout."""
    def line() -> Optional[str]:
        try:
            work()
        except OSError as e:
            return f"{what}: {e.strerror or e}" + (f" ({e.filename})" if getattr(e, "filename", None) else "")
        return None

    error = rank0_outcome(line)
    if error is not None:
        raise OSError(error)


#: how long a rank looks again for a file rank 0 made (a network file system may show a new name late)
SEEN_WAIT_S = 5.0


def who_sees(path: Path, wait_s: Optional[float] = None) -> List[Tuple[bool, str]]:
    """Every rank looks for ``path`` in its own view of its file system, again until ``wait_s`` (default
    :data:`SEEN_WAIT_S`) has passed where it is not there (collective): each rank's (found, host name), in rank
    order."""
    deadline = time.monotonic() + (SEEN_WAIT_S if wait_s is None else wait_s)
    seen = path.exists()
    while not seen and time.monotonic() < deadline:
        time.sleep(0.1)
        seen = path.exists()
    return [(bool(ok), host) for ok, host in with_hosts(seen)]


def shared_folder_problem(directory: Path, views: List[Tuple[bool, str]], what: str) -> Optional[str]:
    """The one line every rank raises where some ranks' ``views`` (:func:`who_sees`) miss ``what``, which rank 0
    sees in the checkpoint folder ``directory``; None where none does. DCP's save has every rank write its own
    shards into one folder and its load has every rank read the folder's metadata: on hosts that do not share
    the folder, a save leaves each host a part of the checkpoint and a resume cannot read it."""
    missing = [f"{r} (host {host})" for r, (ok, host) in enumerate(views) if not ok]
    if not missing or not views[0][0]:  # (what rank 0 does not see either is no question of sharing)
        return None
    shown = ", ".join(missing[:4]) + (f" and {len(missing) - 4} more" if len(missing) > 4 else "")
    return (f"checkpoint folder {directory} is not one folder every rank shares: rank{'s' if len(missing) > 1 else ''} "
            f"{shown} cannot see {what} that rank 0 (host {views[0][1]}) sees there. Every rank writes its "
            f"shards of a checkpoint into that folder and reads them all at a resume: give checkpoint.dir (or "
            f"checkpoint.root) a folder on a file system that every host mounts at the same path")


def check_every_rank_shares(directory: Path) -> None:
    """Before a run saves into ``directory`` (collective): rank 0 makes it and a file in it, and every rank looks
    for that file (:func:`who_sees`). ValueError on every rank, naming the ranks and their hosts, where
    one does not see it (ranks on hosts that each have a folder of that path of their own); the file is removed
    either way. Nothing at one rank."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    name: List[Optional[str]] = [None]

    def make() -> None:
        directory.mkdir(parents=True, exist_ok=True)
        # (named as run_identity.TEMPORARY's write checks: one a kill left behind is no foreign file to a later run)
        token = directory / f".herald-write-check-shared-{uuid.uuid4().hex}"
        token.touch()
        name[0] = token.name

    _on_rank0(make, f"cannot make the checkpoint folder {directory}")
    dist.broadcast_object_list(name, src=0)
    try:
        views = who_sees(directory / str(name[0]))
    finally:
        if _rank() == 0:
            try:
                (directory / str(name[0])).unlink()
            except OSError:  # (gone, or a file system that refuses now: an empty file, named as a check's, is left)
                pass
    problem = shared_folder_problem(directory, views, f"the file {name[0]}")
    if problem is not None:
        raise ValueError(problem)


def checkpoints(directory: Path) -> List[Path]:
    """The ``step_*`` directories under ``directory``, oldest first (complete or not)."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in directory.iterdir() if (m := STEP_DIR.match(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found)]


def _incomplete(path: Path, required: Sequence[str] = ("step",)) -> Optional[str]:
    """Why ``path`` is not a usable checkpoint (``required``: the keys its trainer state must hold), or None."""
    if not (path / ".metadata").is_file():
        return "no .metadata (DCP did not finish writing it)"
    try:
        state = json.loads((path / TRAINER_STATE).read_text())
    except FileNotFoundError:
        return f"no {TRAINER_STATE}"
    except json.JSONDecodeError as e:
        return f"{TRAINER_STATE} is truncated ({e.msg})"
    missing = [k for k in required if k not in state] if isinstance(state, dict) else list(required)
    if missing:
        return f"{TRAINER_STATE} has no {', '.join(missing)}"
    try:
        dcp.FileSystemReader(str(path)).read_metadata()
    except Exception as e:  # noqa: BLE001 - any unreadable metadata makes the checkpoint unusable
        return f"unreadable .metadata ({type(e).__name__}: {e})"
    return None


_WARNED: set = set()


def _warn_once(line: str) -> None:
    """One warning a process for each skipped folder (the checks before training and the resume each look)."""
    if line not in _WARNED:
        _WARNED.add(line)
        logger.warning("%s", line)


def latest_checkpoint(directory: Path, required: Sequence[str] = ("step",), before: Optional[Path] = None
                      ) -> Optional[Path]:
    """The newest complete checkpoint under ``directory`` (its trainer state holding the keys ``required``;
    ``before``: older than that one); every newer incomplete one and every interrupted save is skipped with a
    warning naming it."""
    directory = Path(directory)
    if directory.is_dir():
        for tmp in sorted(p for p in directory.iterdir() if p.name.startswith(".tmp-step_")):
            _warn_once(f"skipping {tmp}: a save that did not finish")
    found = checkpoints(directory)
    if before is not None:
        found = found[:found.index(before)] if before in found else found
    for path in reversed(found):
        why = _incomplete(path, required)
        if why is None:
            return path
        _warn_once(f"skipping checkpoint {path}: {why}; using an older one")
    return None


def none_usable(directory: Path, required: Sequence[str] = ("step",)) -> Optional[str]:
    """Where ``directory`` holds checkpoints and none can be resumed: one line naming the folder and why the newest is
    not usable (a run would start from step 0 and its saves replace them), else None."""
    found = checkpoints(directory)
    if not found or latest_checkpoint(directory, required) is not None:
        return None
    return (f"checkpoint.dir {directory} holds {len(found)} checkpoint(s) and none can be resumed (the newest, "
            f"{found[-1].name}: {_incomplete(found[-1], required)}): restore them, or checkpoint.resume=false to "
            f"move them aside and train from step 0")


def replace_whole(path: Path, text: str) -> None:
    """Write ``path`` whole or not at all: a temporary file beside it, flushed to disk, then renamed over it (a reader,
    or a kill or crash at any moment, finds the old file or the new one, never a part). The temporary is removed
    where anything fails; the OSError is the caller's to name."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def mark_final(directory: Path, step: int) -> None:
    """Rank 0 (collective): record that the checkpoint of ``step`` is the run's end (a periodic save at the run's
    last step), rewriting its trainer state whole (a temporary file, then a rename)."""
    path = Path(directory) / f"step_{step:08d}" / TRAINER_STATE

    def rewrite() -> None:
        replace_whole(path, json.dumps(dict(json.loads(path.read_text()), final=True)))

    _on_rank0(rewrite, f"cannot mark the checkpoint {path.parent} as the run's end")


def _check_shapes(path: Path, state: Dict[str, Any]) -> None:
    """Every tensor of the model's state is in the checkpoint with the same shape, else an error naming
    the table (or key) and both shapes."""
    saved = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    for key, value in state["model"].items():
        if not hasattr(value, "shape"):
            continue
        name = key.split("embedding_bags.")[-1].removesuffix(".weight") if "embedding_bags." in key else key
        fqn = f"model.{key}"
        meta = saved.get(fqn)
        if meta is None:
            raise CheckpointMismatchError(f"checkpoint {path} has no {'table' if name != key else 'tensor'} "
                                          f"{name!r} (model key {key})")
        size = getattr(meta, "size", None)
        if size is not None and tuple(size) != tuple(value.shape):
            raise CheckpointMismatchError(f"{'table' if name != key else 'tensor'} {name!r}: the checkpoint {path} "
                                          f"holds shape {tuple(size)}, the model {tuple(value.shape)}")


def load_checkpoint(path: Path, dmp: torch.nn.Module, optimizer: Any) -> Dict[str, Any]:
    """Load (collective) the checkpoint at ``path`` into ``dmp`` and ``optimizer`` (DCP reshards: a herald
    checkpoint loads into stock ROW_WISE / TABLE_WISE models and back); returns its trainer state."""
    path = Path(path)
    why = _incomplete(path)
    if why is not None:
        raise FileNotFoundError(f"checkpoint {path} is not usable: {why}")
    state = _state(dmp, optimizer)
    _check_shapes(path, state)
    try:
        dcp.load(state, checkpoint_id=str(path))
    except dcp.api.CheckpointException as e:
        rank, first = first_failure(e) or (-1, e)
        problem = " ".join(f"{type(first).__name__}: {first}".split()).removesuffix(":")
        raise ValueError(
            f"checkpoint {path} cannot be read (rank {rank}: {problem}); remove that folder to resume from an "
            f"older checkpoint, or checkpoint.resume=false to start fresh") from None
    dmp.load_state_dict(dict(state["model"]))  # in place already; this lets herald refresh its hot replicas
    optimizer.load_state_dict(_merged(optimizer.state_dict(), state.get("optim", {})))
    trainer_state = json.loads((path / TRAINER_STATE).read_text())
    logger.debug("loaded checkpoint %s (step %d)", path, trainer_state["step"])  # (the trainer says it in one line)
    return trainer_state


def rng_state() -> Dict[str, Any]:
    """Torch's CPU generator state, JSON-able (the trainer state records it)."""
    return {"torch": torch.get_rng_state().tolist()}


def set_rng_state(state: Dict[str, Any]) -> None:
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
