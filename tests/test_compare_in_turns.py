"""``compare_with``'s two runs train in turns of ``compare_turn_steps`` steps in the same ranks
(:func:`torchrec_herald.trainer.train_in_turns`), so that a host whose speed drifts over the job slows both alike.

* Each run trains in turns exactly what it trains alone: the same per-step losses, the same traffic counted by its
  meter, the same herald transfers, the same eval figures, with checkpoints saved inside turns and herald's
  run-ahead scheduler in flight at a turn's end.
* Between turns the run-ahead job in flight finishes and is kept for the next step, not dropped.
* ``compare_turn_steps`` must be a whole number >= 0 (preflight, naming the key: ``test_newcomer.py``).
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any, Dict, List

import pytest

from torchrec_herald.config import compose_config
from torchrec_herald.dist_utils import run_multiprocess

SMALL = ["data.num_train_batches=13", "data.num_eval_batches=2", "batch_size=32", "log_every=5"]
HERALD = ["planner=herald", "planner.link_mbit=null", "pipeline=herald", "pipeline.window=3"]


def _two_runs(rank: int, world: int, out: str, turn_steps: int, herald: List[str]) -> List[Dict[str, Any]]:
    """The baseline (stock TABLE_WISE) and a herald run (``herald``'s pipeline keys), in turns of ``turn_steps`` (0:
    one after the other)."""
    from torchrec_herald.trainer import run_training, train_in_turns

    root = Path(out)
    ckpt = ["checkpoint.every_n_steps=4"]
    base = compose_config(SMALL + ckpt + ["planner=table_wise", f"checkpoint.dir={root / 'ck_base'}"])
    run = compose_config(SMALL + ckpt + HERALD + herald + [f"checkpoint.dir={root / 'ck_run'}"])
    if turn_steps:
        from torchrec_herald.trainer import Trainer

        turns: List[Any] = []
        advance = Trainer._advance

        def recorded(self: Trainer, progress: Any, steps: Any = None) -> bool:
            before = len(progress.losses)
            done = advance(self, progress, steps)
            turns.append((self.run_dir.name, before, len(progress.losses), done))
            return done

        Trainer._advance = recorded  # type: ignore[method-assign]
        try:
            out = train_in_turns([(base, root / "baseline", None), (run, root / "run", None)], turn_steps,
                                 show_progress=False)
        finally:
            Trainer._advance = advance  # type: ignore[method-assign]
        return out + [turns]
    return [run_training(base, root / "baseline", show_progress=False),
            run_training(run, root / "run", show_progress=False)]


@pytest.mark.parametrize("herald", [
    [],  # (2 ranks: every rank plans every row from the whole global batch; the run-ahead job sends nothing)
    # planning by home from each rank's own batches: the run-ahead job exchanges plan metadata, which must land in
    # the run's own meter (it was sent after the turn, uncounted)
    ["pipeline.planning=by_home", "pipeline.allocator=identity", "pipeline.global_batches=false",
     "pipeline.scheduling=on"]], ids=["global", "by_home"])
def test_runs_trained_in_turns_train_measure_and_evaluate_what_each_trains_alone(tmp_path: Path,
                                                                                 herald: List[str]) -> None:
    alone = run_multiprocess(_two_runs, 2, str(tmp_path / "alone"), 0, herald, timeout_s=400)[0]
    *turns, order = run_multiprocess(_two_runs, 2, str(tmp_path / "turns"), 5, herald, timeout_s=400)[0]
    assert order == [("baseline", 0, 5, False), ("run", 0, 5, False), ("baseline", 5, 10, False), ("run", 5, 10, False),
                     ("baseline", 10, 13, True), ("run", 10, 13, True)]
    for name, ck, a, t in zip(("baseline", "run"), ("ck_base", "ck_run"), alone, turns):
        assert t["steps"] == a["steps"] == 13, name
        losses_a, losses_t = (json.loads((tmp_path / mode / name / "losses.json").read_text())
                              for mode in ("alone", "turns"))
        assert losses_t == losses_a, name  # bit for bit, every step
        assert t["traffic_per_step_total"] == a["traffic_per_step_total"], name
        assert t["traffic_per_step_by_tag"] == a["traffic_per_step_by_tag"], name
        assert t["eval"] == a["eval"], name
        # checkpoints were saved inside the turns (4, 8 and 12: turns of 5 end at 5, 10), the last one the run's end
        log = (tmp_path / "turns" / name / "logs" / "rank0.log").read_text()
        assert [f"saved checkpoint {tmp_path / 'turns' / ck / f'step_{n:08d}'}" in log for n in (4, 8, 12, 13)] == [
            True] * 4, log
        assert (sorted(p.name for p in (tmp_path / "turns" / ck).glob("step_*"))
                == sorted(p.name for p in (tmp_path / "alone" / ck).glob("step_*"))), name
    assert turns[1]["herald"] == alone[1]["herald"]  # herald's transfers, predicted and counted
    counts = ("miss_pull", "update_pull", "update_push", "miss_push", "reduce", "plan_transfers_per_step_all_ranks",
              "moved_samples_per_step", "local_lookup_share")
    assert {k: turns[1]["herald_pipeline"][k] for k in counts} == {k: alone[1]["herald_pipeline"][k] for k in counts}
    assert alone[1]["herald_pipeline"]["plan_transfers_per_step_all_ranks"] > 0  # (herald's scheduling trained)
    if herald:  # (the run-ahead job's exchanges were counted)
        assert alone[1]["traffic_per_step_by_tag"]["herald_schedule_meta"]["calls"] > 0
    assert turns[1]["plan"] != turns[0]["plan"]  # (the run is herald's, the baseline stock: two different models)


def test_between_turns_the_run_ahead_job_finishes_and_is_kept_for_the_next_step() -> None:
    from torchrec_herald.pipeline.run_ahead import RunAhead

    ahead, finished = RunAhead(), threading.Event()

    def job() -> str:
        time.sleep(0.3)
        finished.set()
        return "the next step's plan"

    try:
        ahead.submit(job)
        ahead.wait_finished()
        assert finished.is_set() and ahead.busy  # (done, not yet collected)
        result, waited = ahead.collect()
        assert result == "the next step's plan" and waited < 0.1 and not ahead.busy
        ahead.wait_finished()  # (nothing in flight: returns at once)
    finally:
        ahead.shutdown()


def _probe_beside_a_slow_baseline(rank: int, world: int, out: str, turn_steps: int) -> Dict[str, Any]:
    """A herald run with ``scheduling=auto`` (its probe timing steps from one step's start to the next) in turns
    with a baseline whose every step takes 0.4 s longer; the run's probe figures and input skipping's step times."""
    from torchrec_herald.pipeline.build import TorchRecPipeline
    from torchrec_herald.trainer import train_in_turns

    root = Path(out)
    base = compose_config(SMALL + ["planner=table_wise"])
    run = compose_config(SMALL + HERALD + ["pipeline.scheduling=auto", "pipeline.probe_steps=2"])
    skip = compose_config(SMALL + HERALD + ["pipeline.skip=input", "pipeline.skip_start=2", "pipeline.skip_gap=2",
                                            "pipeline.skip_every=6", "pipeline.reference=false"])
    progress = TorchRecPipeline.progress

    def slow(self: TorchRecPipeline, it: Any) -> Any:
        time.sleep(0.4)  # (a turn of it inside one of a probe mode's 2 timed steps: its mean >= 200 ms)
        return progress(self, it)

    TorchRecPipeline.progress = slow  # type: ignore[method-assign]
    try:
        metrics = train_in_turns([(base, root / "baseline", None), (run, root / "run", None),
                                  (skip, root / "skip", None)], turn_steps, show_progress=False)
    finally:
        TorchRecPipeline.progress = progress  # type: ignore[method-assign]
    return {"probe": metrics[1]["herald_pipeline"]["scheduling"], "skip": metrics[2]["approximate"]}


@pytest.mark.parametrize("turn_steps", [1, 3])
def test_the_other_runs_turn_is_no_step_of_a_probe_or_a_skip_search(tmp_path: Path, turn_steps: int) -> None:
    """``scheduling=auto``'s probe and input skipping's threshold search time a step from its start to the next
    step's start: across a turn boundary that held the other run's whole turn (the probe picked scheduling on where
    alone it picked off; input skipping paused where alone it did not, and trained another number of steps). Each
    turn's last step is timed up to the turn's end: with turns of 1 step none was timed, and both probe means read 0."""
    got = run_multiprocess(_probe_beside_a_slow_baseline, 2, str(tmp_path), turn_steps, timeout_s=400)[0]
    probe = got["probe"]
    assert probe["decided"] and 0 < probe["on_ms_per_step"] < 200 and 0 < probe["off_ms_per_step"] < 200, probe
    verdicts = got["skip"]["skip_verdicts"]  # (step, paused, classifier ms, step ms, skipped share) per search
    assert [v[0] for v in verdicts] == [4, 10] and all(0 < v[3] < 200 for v in verdicts), verdicts
