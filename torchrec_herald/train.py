"""Training entry point: ``python -m torchrec_herald.train [hydra overrides]``.

Run under torchrun / torchx for several ranks (``torchrec_herald/components.py:train``); alone it
trains on one rank. Writes ``metrics.json``, ``losses.json``, ``training.png`` and per-rank logs
into the Hydra run dir and prints the metrics table on rank 0.

A run that fails ends with one line, ``<type>: <message>``, naming the key, file or line at fault (rank
0's, or the failing rank's when it alone fails); the traceback goes to the rank's log file, whose path
the line gives. Alone it is printed as ``ERROR: ...`` on stderr; under torchrun / torchx it is the root
cause they show (torchelastic's error file). A check before training that fails on some ranks only (one host's
files) stops every rank: the others end with ``PeerCheckFailed`` naming the failing rank, its host and its line
(:func:`checked_on_every_rank`).
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Dict, List, NoReturn, Optional, Sequence, TypeVar

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from torchrec_herald.launch import FAILED_AT_KEY

logger = logging.getLogger(__name__)


def one_line(e: BaseException) -> str:
    """``"<Type>: <message>"`` on one line, with the first line of its cause when that adds something
    (Hydra's "Could not override 'foo'" is caused by "Key 'foo' not in 'TrainConfig'")."""
    from torchrec_herald.checkpoint import first_failure

    failed = first_failure(e)  # DCP's CheckpointException: the lowest rank's exception
    if failed is not None:
        e = failed[1]
    line = " ".join(f"{type(e).__name__}: {e}".split())
    cause = e.__cause__
    if cause is not None and str(cause).strip():
        first = str(cause).strip().splitlines()[0].strip()
        if first not in line:
            line += f" ({first})"
    return line


T = TypeVar("T")


class PeerCheckFailed(ValueError):
    """Another rank's checks before training failed (this rank's passed): the line names that rank and its host."""


def checked_on_every_rank(checks: Callable[[], T], log_file: Optional[Path] = None) -> T:
    """Run this rank's checks before training (``checks``), then join the process group and learn every rank's
    outcome, so that the ranks stop together. A check can fail on one host alone: a data file missing or unreadable
    there, a checkpoint folder that host cannot write, rank 0's run folder in use. Its ranks ended at once while
    the other hosts' ranks waited for them in the process group's set-up until its timeout (600 s), then named a
    timeout. Now the failing rank raises its own error, and every other rank raises :class:`PeerCheckFailed` naming
    the first failing rank, its host, its line and its log (``log_file``: this rank's). Returns what ``checks``
    returned. A lone process (no ``$WORLD_SIZE`` above 1) raises its error without making a process group."""
    from torchrec_herald.dist_utils import init_distributed, with_hosts

    error: Optional[Exception] = None
    result: Any = None
    try:
        result = checks()
    except Exception as e:  # noqa: BLE001 - whatever stops this rank, the others learn it below
        error = e
    if error is not None and int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        raise error
    try:
        init_distributed()
    except Exception:
        if error is not None:  # (this rank's own error is the one to report)
            raise error from None
        raise
    outcomes = with_hosts((None if error is None else one_line(error), None if log_file is None else str(log_file)))
    if error is not None:
        raise error
    failed = [(r, line, host, log) for r, ((line, log), host) in enumerate(outcomes) if line is not None]
    if failed:
        r, line, host, log = failed[0]
        others = [str(f[0]) for f in failed[1:]]
        more = (f" (ranks {', '.join(others[:4])}{' …' if len(others) > 4 else ''} failed theirs too)"
                if others else "")
        raise PeerCheckFailed(f"rank {r} on host {host} failed its checks before training: {line}"
                              f"{f' (its traceback: {log} on {host})' if log else ''}{more}")
    return result


def fail(e: BaseException, log_file: Optional[Path] = None) -> NoReturn:
    """End this rank with one readable line: the traceback to ``log_file`` (the rank's log), the line to
    torchelastic's error file (torchrun's / torchx's root cause) and, from rank 0 or a rank failing on
    its own, to stderr; exit code 1, at once: a worker thread of herald's (a run-ahead job) may be waiting in a
    collective that the other ranks will never join, and a normal exit would wait for it until gloo's timeout."""
    line = one_line(e)
    # (a peer's failed check names that rank's log: this rank's holds no more of it)
    where = f" (traceback: {log_file})" if log_file is not None and not isinstance(e, PeerCheckFailed) else ""
    if log_file is not None:
        log_file.parent.mkdir(parents=True, exist_ok=True)
        trainer = sys.modules.get("torchrec_herald.trainer")
        if trainer is not None:  # (what the run logged before its log was set up, then why it failed)
            trainer.release_held_logs(log_file.parent.parent)
        with open(log_file, "a") as f:
            f.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} ERROR {line}\n")
            f.write("".join(traceback.format_exception(type(e), e, e.__traceback__)))
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file:  # under torchrun: the line is its root cause (and torchx's final status), once
        tmp = f"{error_file}.{os.getpid()}.tmp"  # (whole or absent: torchrun may terminate this rank meanwhile)
        with open(tmp, "w") as f:
            now = time.time()  # (torchelastic reads the whole seconds; the launcher orders ties by the exact time)
            json.dump({"message": {"message": line + where,
                                   "extraInfo": {"timestamp": str(int(now)), FAILED_AT_KEY: repr(now)}}}, f)
        os.replace(tmp, error_file)
    elif os.environ.get("RANK", "0") == "0" or not _collective(e):
        sys.stderr.write(f"ERROR: {line}{where}\n")
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(1)  # (not sys.exit: it joins every worker thread)


def _collective(e: BaseException) -> bool:
    """Whether every rank raises this error alike (config, data and bad-id errors do), so one rank's line
    is enough; anything else may be one rank's own."""
    from torchrec_herald.data.base import DataFormatError

    return isinstance(e, (ValueError, FileNotFoundError, DataFormatError))


#: Hydra's flags that print, or compose another config than ``train``: the command line is Hydra's alone then
_HYDRA_OWN_FLAGS = ("--cfg", "-c", "--info", "-i", "--help", "-h", "--hydra-help", "--package", "-p", "--config-name",
                    "-cn", "--config-path", "-cp", "--config-dir", "-cd", "--experimental-rerun", "--shell-completion",
                    "-sc")


def check_overrides(overrides: Sequence[str]) -> None:
    """Compose ``conf/train.yaml`` with the command line's overrides (Hydra's compose API), so a bad key
    or group option fails with Hydra's one-line message before anything starts. Hydra's own flags pass: those
    that print or pick another config (``--cfg job``, ``--info``, ``--config-name``) leave it all to Hydra, and
    a multirun's sweeps (``-m batch_size=64,128``) are checked with each sweep's first value."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from torchrec_herald.config import compose_config, key_of_another_option

    if any(a.split("=", 1)[0] in _HYDRA_OWN_FLAGS for a in overrides):
        return
    words = [o for o in overrides if not o.startswith(("-", "hydra.", "hydra/", "+hydra", "~hydra"))]
    first = []
    for o in OverridesParser.create().parse_overrides(words):
        if o.is_sweep_override():
            try:
                first.append(f"{o.get_key_element()}={next(iter(o.sweep_string_iterator()))}")
            except Exception:  # noqa: BLE001 - a sweep only Hydra's sweeper expands (glob, interval): Hydra checks
                return
        else:
            first.append(o.input_line or "")
    try:
        compose_config(first)
    except Exception as e:  # noqa: BLE001 - Hydra's "Could not override": a key of another group option is named
        key = re.match(r"Could not override '([\w.]+)'", str(e))
        elsewhere = key_of_another_option(key.group(1)) if key else None
        if elsewhere is None:
            raise
        raise ValueError(f"Could not override '{key.group(1)}': {elsewhere}") from None
    given = [o.split("=", 1)[1] for o in overrides if o.startswith("hydra.run.dir=")]
    folder = given[-1] if given else "outputs/${oc.env:HERALD_RUN_ID}"  # (train.yaml's default)
    # the run folder, which Hydra would make with a traceback of its own: as given, or the part before its first
    # interpolation (a folder named by the time or the job is made below it)
    fixed = folder if "${" not in folder else str(Path(folder.split("${", 1)[0] + "x").parent)
    if fixed not in ("", "."):
        named = f"hydra.run.dir={folder}" if given else "the run folder (outputs/<run id>)"
        try:
            Path(fixed).mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ValueError(f"{named} cannot be made: {fixed} ({e.strerror or e}); give a writable directory "
                             f"(hydra.run.dir=<folder>)") from None
        try:  # (a folder that exists but takes no file: read-only, or a full disk, where Hydra saves its config)
            with tempfile.NamedTemporaryFile(dir=fixed, prefix=".write-test-") as probe:
                probe.write(bytes(64 << 10))  # (Hydra's config and the run's first figures: tens of KB)
                probe.flush()
                os.fsync(probe.fileno())
        except OSError as e:
            raise ValueError(f"{named} takes no file: {fixed} ({e.strerror or e}); give a writable directory "
                             f"(hydra.run.dir=<folder>)") from None


@hydra.main(version_base="1.3", config_path="conf", config_name="train")
def _hydra_main(cfg: DictConfig) -> None:
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    log_file = run_dir / "logs" / f"rank{os.environ.get('RANK', '0')}.log"
    try:
        _run(cfg, run_dir)
    except (SystemExit, KeyboardInterrupt):
        raise
    except BaseException as e:  # noqa: BLE001 - one readable line for whatever went wrong (DCP's errors are
        fail(e, log_file)       # BaseExceptions)


#: what a finished run leaves in its folder, beside its logs and Hydra's ``.hydra``
RUN_FIGURES = ("metrics.json", "losses.json", "training.png", "comparison.md", "comparison.json", "comparison.png")
_RUN_FOLDER_LOCK: List[int] = []  # (rank 0's lock on its run folder: held until the process ends)


def claim_run_folder(run_dir: Path) -> None:
    """Rank 0, before anything trains: make the run folder this job's while it runs (an exclusive lock on
    ``.run.lock`` in it: a second job given the same folder, by ``HERALD_RUN_ID``, torchx's ``--run_id`` or
    ``hydra.run.dir``, wrote its figures over the first's; ValueError naming the folder and the job holding it)."""
    from torchrec_herald.run_identity import UNGUARDED, exclusive_lock

    run_dir.mkdir(parents=True, exist_ok=True)
    held = exclusive_lock(run_dir / ".run.lock", f"run folder {run_dir}")
    if isinstance(held, int):
        _RUN_FOLDER_LOCK.append(held)
    elif held != UNGUARDED:
        raise ValueError(f"run folder {run_dir} is in use by another job ({held}): give this one a folder of its own "
                         f"(torchx --run_id, HERALD_RUN_ID or hydra.run.dir), or run it once that one ends")


def set_earlier_figures_aside(run_dir: Path) -> Optional[Path]:
    """Rank 0, once the run's checks passed and before it trains: an earlier finished run's figures in the run folder
    (the same ``HERALD_RUN_ID``, ``--run_id`` or ``hydra.run.dir``; they were overwritten) moved into
    ``earlier-<time>/`` there, with one warning. Returns that folder, or None."""
    import shutil

    if not (run_dir / "metrics.json").is_file():
        return None
    aside = run_dir / f"earlier-{time.strftime('%Y%m%d-%H%M%S')}"
    while aside.exists():
        aside = aside.with_name(aside.name + "_")
    aside.mkdir()
    moved = [p for p in (run_dir / n for n in RUN_FIGURES) if p.exists()]
    moved += sorted(p for p in run_dir.iterdir() if p.is_dir() and (p.name.startswith("baseline_")
                                                                       or p.name == "exact_reference"))
    for p in moved:
        shutil.move(str(p), str(aside / p.name))
    logging.getLogger(__name__).warning("run folder %s held an earlier run's figures: moved to %s", run_dir, aside)
    return aside


def baseline_overrides(task: List[str], planner: Optional[str], compare_with: str) -> List[str]:
    """The command line of ``compare_with``'s baseline: the run's own overrides but its planner and pipeline
    (TorchRec's pipeline, ``planner=<compare_with>``); where the baseline's planner is the run's own, the run's
    ``planner.*`` keys too (a stated link, a memory budget: both runs plan alike)."""
    kept = [o for o in task if not o.lstrip("+~").startswith(("planner", "pipeline", "compare_with"))]
    if planner == compare_with:
        kept += [o for o in task if o.lstrip("+~").startswith("planner.")]
    return kept + [f"planner={compare_with}"]


def _run(cfg: DictConfig, run_dir: Path) -> None:
    import torch.distributed as dist

    from hydra import compose

    from torchrec_herald.data.base import check_same_data_on_every_rank
    from torchrec_herald.dist_utils import rank0_outcome
    from torchrec_herald.report import write_comparison
    from torchrec_herald.run_identity import companion_run
    from torchrec_herald.trainer import (check_not_the_run_folder, format_comparison_table, format_metrics_table,
                                         hold_logs, preflight, run_training, setup_logging, train_in_turns)

    hc = HydraConfig.get()
    hold_logs()  # (the checks log into the run's folder once it is set up below)
    rank0 = os.environ.get("RANK", "0") == "0"
    baseline_run: List[Any] = []  # (compare_with's: its config, folder and checked data)

    def checks() -> Any:  # the run's settings and its baseline's fail here, before anything trains or moves
        if rank0:
            claim_run_folder(run_dir)
        checked = preflight(cfg)
        check_not_the_run_folder(cfg, run_dir)
        if cfg.compare_with:
            # the same job with planner=<compare_with> and TorchRec's pipeline: same data, same global
            # batches, same initial weights
            overrides = baseline_overrides(list(hc.overrides.task), hc.runtime.choices.get("planner"),
                                           cfg.compare_with)
            base_cfg = compose(config_name="train", overrides=overrides)
            base_cfg.compare_with = None
            companion_run(base_cfg, f"baseline_{cfg.compare_with}")  # never the herald run's checkpoints
            baseline_run.append((base_cfg, run_dir / f"baseline_{cfg.compare_with}", preflight(base_cfg)))
        # (its files read here, an unreadable one this rank's check; a lone process has no other copy to compare)
        return checked, checked.fingerprint() if int(os.environ.get("WORLD_SIZE", "1")) > 1 else []

    # (one host's failure stops every host's ranks, naming it)
    data, files = checked_on_every_rank(checks, run_dir / "logs" / f"rank{os.environ.get('RANK', '0')}.log")
    check_same_data_on_every_rank(files)  # (each host's copy of the data files: the same bytes)

    def figures_aside() -> Optional[str]:  # (rank 0's; only once the checks passed: a re-run with a typo moves nothing)
        try:
            set_earlier_figures_aside(run_dir)
        except OSError as e:
            return f"cannot move the earlier run's figures in {run_dir} aside ({e.strerror or e}): nothing was trained"
        return None

    problem = rank0_outcome(figures_aside)
    if problem is not None:
        raise OSError(problem)
    setup_logging(run_dir)  # (the run's checks logged into its own folder, not a baseline's)
    runs = baseline_run + [(cfg, run_dir, data)]
    if len(runs) > 1 and cfg.compare_turn_steps:  # (in turns: a host drifting over the job slows both alike)
        *done, metrics = train_in_turns(runs, cfg.compare_turn_steps)
    else:  # (one after the other: one model in memory at a time)
        *done, metrics = [run_training(c, d, data=x) for c, d, x in runs]  # trains
    baseline = done[0] if done else None
    if dist.get_rank() == 0:
        if baseline is None:
            sys.stdout.write(f"\n{format_metrics_table(metrics)}\n\nmetrics: {run_dir / 'metrics.json'}\n")
        else:
            name = run_label(cfg, metrics)
            runs = {f"{cfg.compare_with} (baseline)": baseline, name: metrics}
            losses = {n: json.loads((d / "losses.json").read_text()) for n, d in
                      zip(runs, (run_dir / f"baseline_{cfg.compare_with}", run_dir))}
            table = format_comparison_table(runs, losses)
            paths = write_comparison(run_dir, runs, losses, table)
            sys.stdout.write(f"\n{table}\n\nmetrics: {run_dir / 'metrics.json'}\ncomparison: {paths['png']} "
                             f"(and {paths['md'].name}, {paths['json'].name})\n")
        sys.stdout.flush()
    dist.destroy_process_group()


def run_label(cfg: DictConfig, metrics: Dict[str, Any]) -> str:
    """The compared run's name, saying what it trained: herald's plan (or herald's tables beside stock ones) with
    or without scheduling and with its approximate mode, or the stock plan the model of time chose (TABLE_WISE
    or TorchRec's default; an approximate mode asked for is then said not to run)."""
    decision = metrics.get("link_decision") or {}
    approx = ", ".join(f"{k}={cfg.pipeline.get(k)}" for k in ("staleness", "skip")
                       if cfg.pipeline.name == "herald" and cfg.pipeline.get(k) is not None)
    if decision and not decision.get("herald", True):
        chosen = {"default": "default plan"}.get(decision.get("chosen"), decision.get("chosen") or "table_wise")
        return f"{cfg.planner.name} -> {chosen} (link model{'; ' + approx + ' not applied' if approx else ''})"
    base = cfg.planner.name + (" per table" if decision.get("chosen") == "mixed" else "")
    if cfg.pipeline.name != "herald":
        return base
    sched = metrics.get("herald_pipeline", {}).get("scheduling", {})
    if sched.get("mode") == "off":  # (auto chose off, or a run shorter than the probe ended with it off)
        why = "auto" if sched.get("decided") else "the probe did not finish" if "why" in sched else "set"
        return f"{base} (scheduling off: {why})" + (f" + {approx}" if approx else "")
    return f"{base} + scheduling" + (f" + {approx}" if approx else "")


def job_run_id() -> Optional[str]:
    """The run folder's name (``outputs/<it>``) where no launcher gave one (``HERALD_RUN_ID``; the torchx component
    does): the start time of the process that started this rank, and its pid. Every rank torchrun starts on a host
    has one parent, its agent, so they share one folder (each resolved Hydra's ``${now:...}`` on its own clock, and
    two ranks could straddle a second), and two runs started in the same second get two folders (one wrote over the
    other's figures and logs). A lone process is its own starter. None where ``/proc`` cannot tell (Hydra's
    ``${now:...}`` then).

    A job whose ranks span hosts has one agent per host, each with its own pid and start time: there the folder is
    named by torchrun's rendezvous id (``--rdzv-id``, ``$TORCHELASTIC_RUN_ID``), which every host's ranks share, so
    one job writes one folder on a shared ``outputs/`` (it was one folder per host, rank 0's alone with the
    figures)."""
    rdzv = os.environ.get("TORCHELASTIC_RUN_ID", "none")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if rdzv not in ("", "none") and world > int(os.environ.get("LOCAL_WORLD_SIZE", world)):
        return rdzv.replace(os.sep, "_")
    pid = os.getppid() if "LOCAL_RANK" in os.environ else os.getpid()
    try:
        ticks = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])  # field 22: starttime
        boot = next(int(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                    if line.startswith("btime "))
    except (OSError, ValueError, IndexError, StopIteration):
        return None
    started = boot + ticks / os.sysconf("SC_CLK_TCK")
    return f"{time.strftime('%Y-%m-%d_%H-%M-%S', time.localtime(started))}_{pid}"


def main() -> None:
    try:
        check_overrides(sys.argv[1:])
    except Exception as e:  # noqa: BLE001 - Hydra's composition errors, one line
        fail(e)
    if "HERALD_RUN_ID" not in os.environ:
        run_id = job_run_id()
        if run_id is not None:
            os.environ["HERALD_RUN_ID"] = run_id
    _hydra_main()


if __name__ == "__main__":
    main()
