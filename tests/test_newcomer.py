"""A newcomer's run (issue 13): every bad setting fails in ``preflight`` with one line naming the key or
file, before anything trains; metric keys say scope and unit; the comparison report and the benchmark
plot are written from the run's data (their data is checked, not their pixels)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, List

import pytest

from herald_harness import preflight_error
from torchrec_herald.config import compose_config

GOOD_TSV_LINE = "1\t" + "\t".join(["1"] * 13) + "\t" + "\t".join(["a"] * 26)


_error = preflight_error


@pytest.mark.parametrize("overrides, message", [
    (["optimizer.name=adam"], "ValueError: unknown optimizer.name 'adam'; expected one of ['rowwise_adagrad', 'sgd']"),
    (["batch_size=0"], "ValueError: batch_size must be >= 1, got 0"),
    (["compare_turn_steps=-1"], "ValueError: compare_turn_steps must be a whole number of steps >= 0 (0: the baseline "
                                "trains in full first), got -1"),
    (["planner=herald", "planner.link_mbit=[200,100]"],
     "ValueError: planner.link_mbit must be > 0 Mbit/s, auto (measured at start) or null (unknown), got [200, 100]"),
    (["planner=herald", "planner.collective_latency_ms={a:1}"],
     "ValueError: planner.collective_latency_ms must be > 0 ms or auto (measured at start), got {'a': 1}"),
    (["data.num_train_batches=0"], "ValueError: data.num_train_batches=0 leaves nothing to train; give at least 1"),
    (["compare_with=nope"], "ValueError: compare_with='nope' is not a planner option; one of ['herald', 'row_wise', "
                            "'stock', 'table_wise']"),
    (["planner.mode=bogus"], "ValueError: unknown planner.mode 'bogus'"),
    (["planner=herald", "planner.selector=best"], "ValueError: unknown planner.selector 'best'"),
    (["planner=herald", "planner.hot_memory_budget_bytes=-1"],
     "ValueError: planner.hot_memory_budget_bytes must be >= 0, got -1"),
    (["pipeline=herald"], "ValueError: pipeline=herald needs planner=herald (its embeddings must be herald-sharded); "
                          "got planner=stock"),
    # (it said planner.name='stock', a value the user never typed)
    (["planner=table_wise", "pipeline=herald"], "ValueError: pipeline=herald needs planner=herald (its embeddings must "
                                                "be herald-sharded); got planner=table_wise"),
    (["planner=herald", "planner.link_mbit=null", "pipeline=herald", "pipeline.window=100000"],
     "ValueError: pipeline.window=100000 is larger than the 1000 batch(es) the data loader has "
     "(data.num_train_batches); lower pipeline.window"),
    (["model.embedding_dim=6", "model.dense_arch=[4,6]"],
     "ValueError: model.embedding_dim must be a positive multiple of 4 (fbgemm's TBE kernels), got 6"),
    (["planner=herald", "pipeline=herald", "pipeline.cache_fraction=0"],
     "ValueError: pipeline.cache_fraction=0: a cache must hold at least one row"),
    (["planner=herald", "pipeline=herald", "pipeline.staleness=-1"],
     "ValueError: pipeline.staleness must be null (exact) or an integer >= 0, got -1"),
    (["planner=herald", "pipeline=herald", "pipeline.skip=row", "pipeline.skip_start=995"],
     "ValueError: pipeline.skip snapshots at steps 995 and 1005 are beyond the run's 1000 steps"),
    (["pipeline.name=bogus"], "ValueError: unknown pipeline.name 'bogus'"),
    (["pipeline.name=herald"], "ValueError: pipeline.name 'herald' where this pipeline option's is one of TorchRec's "
                               "['base', 'sparse_dist']: the option sets it; pick the pipeline with pipeline=<option> "
                               "(pipeline=herald, pipeline=sparse_dist, pipeline=base)"),
    (["planner.name=herald"], "ValueError: planner.name 'herald' where this planner option's is 'stock': the option "
                              "sets it; pick the planner with planner=<option> (planner=herald, planner=table_wise, ...)"),
    (["model.embedding_dim=8"], "ValueError: model.dense_arch must end with model.embedding_dim=8, got [64, 16]"),
    (["model.pooling=MAX"], "ValueError: model.pooling must be SUM or MEAN, got 'MAX'"),
    (["model.dense_arch=[]"], "ValueError: model.dense_arch must be a non-empty list of layer sizes >= 1, got []"),
    (["model.dense_arch=[0,16]"], "ValueError: model.dense_arch must be a non-empty list of layer sizes >= 1, got [0, 16]"),
    (["model.over_arch=[64,32,2]"], "ValueError: model.over_arch must have at least two layers and end with 1 (the "
                                    "click logit), got [64, 32, 2]"),
    (["model.over_arch=[1]"], "ValueError: model.over_arch must have at least two layers and end with 1 (the click "
                              "logit), got [1]"),
    (["model.over_arch=[]"], "ValueError: model.over_arch must be a non-empty list of layer sizes >= 1, got []"),
    (["optimizer.lr=nan"], "ValueError: optimizer.lr must be a finite number > 0, got nan"),
    (["optimizer.dense_lr=0"], "ValueError: optimizer.dense_lr must be a finite number > 0, got 0.0"),
    (["optimizer.eps=-1"], "ValueError: optimizer.eps must be a finite number >= 0, got -1.0"),
    (["planner=herald", "planner.selector=top_fraction", "planner.top_fraction=2"],
     "ValueError: planner.top_fraction must be at most 1 (the share of each table's rows replicated), got 2.0"),
    (["planner=herald", "planner.cpu_us_per_lookup=-1"], "ValueError: planner.cpu_us_per_lookup must be a finite number "
                                                         ">= 0, got -1.0"),
    (["planner=herald", "planner.cpu_us_per_lookup=nan", "planner.link_mbit=100"],
     "ValueError: planner.cpu_us_per_lookup must be a finite number >= 0, got nan"),
    (["planner=herald", "planner.hot_memory_budget_bytes=999999999999999999"],
     "ValueError: planner.hot_memory_budget_bytes=999999999999999999 is more than a rank can hold ("),
    (["planner=herald", "pipeline=herald", "pipeline.staleness=1", "pipeline.scheduling=off"],
     "ValueError: pipeline.staleness bounds the staleness of Herald scheduling's caches: it needs "
     "pipeline.scheduling=on or auto, got pipeline.scheduling=off"),
    (["planner=herald", "pipeline=herald", "pipeline.cache_bytes=1"],
     "ValueError: pipeline.cache_bytes=1 holds 0 rows of 68 bytes; the 26 tables need at least one cache row each "
     "(1768 bytes)"),
    (["planner=herald", "pipeline=herald", "pipeline.cache_bytes=100"],  # one row, not one a table: the pipeline's
     "ValueError: pipeline.cache_bytes=100 holds 1 rows of 68 bytes; the 26 tables need at least one cache row each "
     "(1768 bytes)"),
    (["planner=herald", "pipeline=herald", "pipeline.planning=__init__"],
     "ValueError: unknown pipeline.planning '__init__'; known: ['auto', 'global', 'by_home']"),
    (["checkpoint.every_n_steps=0"], "ValueError: checkpoint.every_n_steps must be >= 1 (or null: no checkpoints), got 0"),
    (["planner=herald", "pipeline=herald", "+pipeline.stalenes=1"],  # a typo added with +: it was ignored silently
     "ValueError: unknown key pipeline.stalenes: pipeline has no such key (known: allocator, cache, "),
    (["+new_key=1"], "ValueError: unknown key new_key: the config has no such key (known: batch_size, "),
    (["~eval"], "ValueError: eval was deleted (~eval): every key has a default; set it instead"),  # (it crashed
    (["planner=herald", "planner.link_mbit=200", "pipeline=herald", "pipeline.window=20"],  # (found after the
     "ValueError: pipeline.window=20 is larger than the 15 steps scheduling=auto probes with scheduling on "),  # baseline)
    (["~log_every"], "ValueError: log_every was deleted (~log_every): every key has a default; set it instead"),
    (["checkpoint.keep=0"], "ValueError: checkpoint.keep must be >= 1, got 0"),
    (["planner=herald", "pipeline=herald", "pipeline.staleness=1", "checkpoint.every_n_steps=10"],
     "ValueError: checkpoint.every_n_steps with pipeline.staleness / pipeline.skip is not supported"),
])
def test_bad_setting_fails_in_preflight_naming_its_key(overrides: List[str], message: str) -> None:
    assert _error(overrides).startswith(message), _error(overrides)


def test_checkpoint_dir_that_is_a_file_fails_in_preflight_naming_the_key(tmp_path: Path) -> None:
    f = tmp_path / "ckpt"
    f.write_text("not a folder")
    assert _error([f"checkpoint.dir={f}"]) == (f"ValueError: checkpoint.dir={f} is a file, not a directory; "
                                               f"give a directory")
    assert _error([f"checkpoint.dir={f}/run1", "checkpoint.every_n_steps=5"]) == (
        f"ValueError: checkpoint.dir={f}/run1 lies under {f}, which is a file, not a directory; give a directory")
    assert _error([f"checkpoint.root={f}"]).startswith(f"ValueError: checkpoint.root={f} is a file")


def test_checkpoint_dir_that_is_a_link_to_nothing_fails_in_preflight_naming_the_key(tmp_path: Path) -> None:
    """A ``checkpoint.dir`` linking to a folder that is gone passed the checks (the write check ran in its parent)
    and failed at the first save, after training, with "File exists"."""
    link = tmp_path / "dangling"
    link.symlink_to(tmp_path / "gone" / "ckpts")
    assert _error([f"checkpoint.dir={link}", "checkpoint.every_n_steps=5"]) == (
        f"ValueError: checkpoint.dir={link} is a link to {tmp_path / 'gone' / 'ckpts'}, which does not exist; make "
        f"that folder, or give another")
    assert _error([f"checkpoint.dir={link}/run1", "checkpoint.every_n_steps=5"]) == (
        f"ValueError: checkpoint.dir={link}/run1 lies under {link}, which is a link to {tmp_path / 'gone' / 'ckpts'}, "
        f"which does not exist; make that folder, or give another")
    (tmp_path / "gone" / "ckpts").mkdir(parents=True)
    assert _error([f"checkpoint.dir={link}", "checkpoint.every_n_steps=5"]) == "no error"


def test_unwritable_checkpoint_dir_fails_in_preflight_naming_the_key() -> None:
    """/proc refuses new files even to root (a chmod would not stop root)."""
    d = "/proc/herald-checkpoints"
    assert _error([f"checkpoint.dir={d}", "checkpoint.every_n_steps=5"]).startswith(
        f"ValueError: checkpoint.dir={d} is not writable: no file can be created in /proc (")
    assert _error([f"checkpoint.dir={d}"]) == "no error"  # no checkpoints saved: nothing is written there


def test_bad_run_name_fails_in_preflight() -> None:
    assert _error(["run_name=../x"]).startswith("ValueError: run_name='../x' must be a folder name")


@pytest.mark.parametrize("records, holdout, ok", [(2 * 64 * 3, "10", True), (2 * 64 * 3 - 1, "10", False),
                                                  (2 * 64 * 3, "3", False), (2 * 64 * 4, "3", True)])
def test_window_is_checked_against_a_files_batches_before_training(tmp_path: Path, monkeypatch: Any,
                                                                   records: int, holdout: str, ok: bool) -> None:
    """A file source has no ``num_train_batches``: preflight parses the file's first records until the
    window's global batches are found (every ``holdout_every``-th one held out), at 2 ranks × 64."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    f = tmp_path / "day_0.tsv"
    f.write_text((GOOD_TSV_LINE + "\n") * records)
    got = _error(["planner=herald", "planner.link_mbit=null", "pipeline=herald", "pipeline.window=3", "batch_size=64",
                  "data=criteo_tsv",
                  f"data.paths={f}", f"data.holdout_every={holdout}", "eval=false"])
    if ok:
        assert got == "no error"
    else:
        found = (records // 128) - (records // 128) // int(holdout)
        assert got == (f"ValueError: pipeline.window=3 is larger than the {found} global batch(es) of 2 × 64 "
                       f"samples that CriteoTSV(day_0.tsv) holds (data.paths); lower pipeline.window")


def test_an_eval_split_without_a_sample_or_of_training_files_fails_in_preflight(tmp_path: Path, monkeypatch: Any
                                                                                  ) -> None:
    """Each trained to its end, then reported an AUC of NaN (no held-out sample), or of 0.996 (the eval file was a
    training file)."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    f, e = tmp_path / "day_0.tsv", tmp_path / "day_1.tsv"
    f.write_text((GOOD_TSV_LINE + "\n") * 200)  # 25 global batches of 2 × 4
    e.write_text((GOOD_TSV_LINE + "\n") * 3)
    tsv = ["data=criteo_tsv", f"data.paths={f}", "batch_size=4"]
    assert _error(tsv + ["data.holdout_every=30"]) == (
        "ValueError: CriteoTSV(day_0.tsv) holds out no sample to evaluate: data.holdout_every=30 holds out every 30th "
        "global batch of 2 × 4 samples, and data.paths holds fewer than 29 global batches and one sample; lower data.holdout_every, give "
        "data.eval_paths, or eval=false")
    assert _error(tsv + ["data.holdout_every=25"]) == "no error"  # (batch 24 is held out)
    assert _error(tsv + ["data.holdout_every=30", "eval=false"]) == "no error"
    assert _error(tsv + [f"data.eval_paths={e}"]) == "no error"  # (3 samples: one padded global batch)
    assert _error(tsv + [f"data.eval_paths=[{e},{tmp_path}/./day_0.tsv]"]) == (
        f"ValueError: {tmp_path}/./day_0.tsv is in data.paths and in data.eval_paths: the eval would score rows the "
        f"model trained on; give held-out files as data.eval_paths, or leave it out to hold out every "
        f"data.holdout_every-th global batch of data.paths")
    assert _error(tsv + [f"data.paths=[{f},{f}]"]) == (
        f"ValueError: data.paths lists {f} more than once: each file is read once a pass; give it once")
    assert _error(["data.num_eval_batches=0"]) == (
        "ValueError: data.num_eval_batches=0 leaves nothing to evaluate; give at least 1, or eval=false")
    assert _error(["data.num_eval_batches=0", "eval=false"]) == "no error"


def test_good_settings_pass_preflight() -> None:
    for overrides in ([], ["planner=herald", "pipeline=herald", "compare_with=table_wise"],
                      ["planner=herald", "planner.hot_memory_budget_bytes=1", "pipeline=herald"],
                      # one rank, the link left to measure: the model of time trains stock TABLE_WISE with
                      # TorchRec's pipeline, which fills no window
                      ["planner=herald", "pipeline=herald", "pipeline.window=100000"]):
        assert _error(overrides) == "no error", overrides


def test_data_without_one_full_global_batch_is_named_not_the_window(tmp_path: Path, monkeypatch: Any) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    f = tmp_path / "day_0.tsv"
    f.write_text((GOOD_TSV_LINE + "\n") * 100)
    assert _error(["planner=herald", "planner.link_mbit=null", "pipeline=herald", "pipeline.window=1", "batch_size=64",
                   "data=criteo_tsv", f"data.paths={f}"]) == (
        "ValueError: CriteoTSV(day_0.tsv) holds no full global batch of 2 × 64 samples to train (data.paths); lower "
        "batch_size or give more data")


def test_preflight_counts_a_files_first_global_batches_once(tmp_path: Path, monkeypatch: Any) -> None:
    """A herald pipeline's preflight needs a full global batch and a full window: one count of the file's first
    ``window`` global batches serves both checks (it parsed them twice)."""
    from torchrec_herald.data.files import FileSource

    monkeypatch.setenv("WORLD_SIZE", "2")
    f = tmp_path / "day_0.tsv"
    f.write_text((GOOD_TSV_LINE + "\n") * 300)
    calls: List[Any] = []
    count = FileSource.count_train_batches
    monkeypatch.setattr(FileSource, "count_train_batches",
                        lambda self, *a, **k: calls.append(k.get("at_least")) or count(self, *a, **k))
    overrides = ["planner=herald", "planner.link_mbit=null", "pipeline=herald", "batch_size=32", "data=criteo_tsv",
                 f"data.paths={f}", "eval=false"]
    assert _error(overrides + ["pipeline.window=4"]) == "no error"
    assert calls == [4]
    assert _error(overrides + ["pipeline.window=5"]) == (
        "ValueError: pipeline.window=5 is larger than the 4 global batch(es) of 2 × 32 samples that "
        "CriteoTSV(day_0.tsv) holds (data.paths); lower pipeline.window")
    assert calls == [4, 5]
    assert _error(["batch_size=32", "data=criteo_tsv", f"data.paths={f}", "eval=false"]) == "no error"  # (stock: one batch asked)
    assert calls == [4, 5, 1]


@pytest.mark.parametrize("content, problem", [
    ("", "the file is empty"),
    ("0\tnot-a-number\n", "expected 40 tab-separated fields, got 2"),
])
def test_bad_data_file_is_named_in_preflight(tmp_path: Path, content: str, problem: str) -> None:
    f = tmp_path / "day_0.tsv"
    f.write_text(content)
    assert _error(["data=criteo_tsv", f"data.paths={f}"]) == f"DataFormatError: {f}:1: {problem}"
    good = tmp_path / "good.tsv"
    good.write_text(GOOD_TSV_LINE + "\n")
    assert _error(["data=criteo_tsv", f"data.paths=[{good},{f}]"]) == f"DataFormatError: {f}:1: {problem}"
    assert _error(["data=criteo_tsv", f"data.paths={good}", "batch_size=1", "eval=false"]) == "no error"


def test_a_file_of_only_bad_records_is_named_even_when_skipping(tmp_path: Path) -> None:
    f = tmp_path / "junk.tsv"
    f.write_text("junk\n" * 5)
    assert _error(["data=criteo_tsv", f"data.paths={f}", "data.on_error=skip"]) == \
        f"DataFormatError: {f}:1: the file holds no records"


def test_too_few_samples_for_a_global_batch_names_the_source(tmp_path: Path) -> None:
    from torchrec_herald.dist_utils import run_multiprocess

    f = tmp_path / "small.tsv"
    f.write_text((GOOD_TSV_LINE + "\n") * 3)
    # (in preflight, before the model is built: it failed after training had begun, 'no training step ran')
    with pytest.raises(RuntimeError, match=r"ValueError: CriteoTSV\(small\.tsv\) holds no full global batch of 1 × 256 "
                                           r"samples to train \(data\.paths\); lower batch_size or give more data"):
        run_multiprocess(_train, 1, ["data=criteo_tsv", f"data.paths={f}", "eval=false"], str(tmp_path / "run"),
                         timeout_s=120)


def _train(rank: int, world: int, overrides: List[str], run_dir: str) -> Any:
    from torchrec_herald.trainer import run_training

    return run_training(compose_config(overrides), Path(run_dir), show_progress=False)


# ---------------------------------------------------------------------- metrics and reports


def _metrics(tags: Dict[str, float], untagged: float, vectors: float, samples_per_s: float) -> Dict[str, Any]:
    total = sum(tags.values()) + untagged
    return {"steps": 10, "world_size": 2, "samples_per_s": samples_per_s, "train_time_s": 1.0,
            "step_time_s": {"p50": 0.01}, "eval": {"auc": 0.75, "logloss": 0.5},
            "traffic_per_step_total": {"bytes": total, "embedding_vectors": vectors, "calls": 8.0},
            "traffic_per_step_by_tag": {t: {"bytes": b} for t, b in tags.items()},
            "config": {"model": {"embedding_dim": 16}, "optimizer": {"name": "sgd"}}}


STOCK = _metrics({"dense_allreduce": 220_000.0}, untagged=900_000.0, vectors=13_000.0, samples_per_s=40_000.0)
HERALD = _metrics({"dense_allreduce": 220_000.0, "herald_pull": 60_000.0, "herald_reduce": 52_000.0,
                   "herald_samples": 66_000.0, "herald_schedule_meta": 12_000.0},
                  untagged=0.0, vectors=1_750.0, samples_per_s=20_000.0)


def test_traffic_parts_add_up_and_say_what_they_are() -> None:
    from torchrec_herald.report import traffic_groups

    s = traffic_groups(STOCK)
    assert s == {"embedding vectors": 13_000 * 16 * 4, "ids and lengths": 900_000 - 13_000 * 64,
                 "scheduling": 0.0, "dense all-reduce": 220_000.0}
    h = traffic_groups(HERALD)
    assert h["scheduling"] == 78_000.0 and h["dense all-reduce"] == 220_000.0
    for m, g in ((STOCK, s), (HERALD, h)):
        assert sum(g.values()) == pytest.approx(m["traffic_per_step_total"]["bytes"])


def test_rows_moved_with_row_wise_adagrad_carry_their_state_float_in_the_embedding_bytes() -> None:
    """With row-wise Adagrad, each row herald's plan moves (pull, update push, push-pull: D + 1 floats) carries one
    state float beside its D: the embedding bytes count it; with SGD a moved row is its D floats alone."""
    from torchrec_herald.report import embedding_bytes_per_step

    tags = {"dense_allreduce": 220_000.0, "herald_pull": 60_000.0, "herald_update_push": 6_800.0,
            "herald_push_pull": 13_600.0, "herald_reduce": 52_000.0}
    adagrad = _metrics(tags, untagged=0.0, vectors=1_750.0, samples_per_s=20_000.0)
    adagrad["config"]["optimizer"]["name"] = "rowwise_adagrad"
    assert embedding_bytes_per_step(adagrad) == 1_750 * 16 * 4 + (60_000 + 6_800 + 13_600) / 17
    sgd = _metrics(tags, untagged=0.0, vectors=1_750.0, samples_per_s=20_000.0)
    assert embedding_bytes_per_step(sgd) == 1_750 * 16 * 4


def test_summary_keys_say_scope_and_unit() -> None:
    from torchrec_herald.report import headline

    h = headline(STOCK)
    assert h["bytes_per_step_all_ranks"] == 1_120_000.0
    assert h["embedding_bytes_per_step_all_ranks"] == 13_000 * 64
    assert h["dense_allreduce_bytes_per_step_all_ranks"] == 220_000.0
    assert h["embedding_vectors_per_step_all_ranks"] == 13_000.0
    assert h["collective_calls_per_step_per_rank"] == 4.0
    assert h["samples_per_s_all_ranks"] == 40_000.0 and h["step_time_ms_p50"] == 10.0
    assert all(k.endswith(("_all_ranks", "_per_rank", "_ms_p50", "_s", "steps", "auc", "logloss")) for k in h), h


def test_comparison_report_files_hold_the_runs(tmp_path: Path) -> None:
    from torchrec_herald.report import write_comparison

    runs = {"table_wise (baseline)": STOCK, "herald + scheduling": HERALD}
    losses = {n: [0.7 - 0.001 * i for i in range(100)] for n in runs}
    paths = write_comparison(tmp_path, runs, losses, "| metric | a | b |")
    assert paths == {k: tmp_path / f"comparison.{k}" for k in ("md", "json", "png")}
    assert paths["md"].read_text() == "| metric | a | b |\n"
    data = json.loads(paths["json"].read_text())
    assert data["baseline"] == "table_wise (baseline)" and data["compared"] == "herald + scheduling"
    assert data["runs"]["herald + scheduling"]["summary"]["embedding_bytes_per_step_all_ranks"] == 1_750 * 64
    assert data["ratio_last_to_first"]["embedding_bytes_per_step_all_ranks"] == pytest.approx(1_750 / 13_000)
    assert data["ratio_last_to_first"]["samples_per_s_all_ranks"] == 0.5
    assert paths["png"].stat().st_size > 20_000  # a drawn figure, not an empty canvas


def test_the_comparison_says_how_far_apart_the_losses_are_and_its_json_is_strict(tmp_path: Path) -> None:
    """The figure's title said "the curves lie on each other" whatever they did, and the table's 4 decimals showed a
    gap of 3e-4 as +0.0000; a run without an eval pass wrote NaN into comparison.json."""
    import math

    from torchrec_herald.report import format_comparison_table, loss_gap, write_comparison

    base = [0.7 - 0.001 * i for i in range(60)]
    off = base[:40] + [x + 9.4e-4 for x in base[40:]]
    assert loss_gap({"a": base, "b": list(base)}) == "identical over 60 steps"
    assert loss_gap({"a": base, "b": off}) == "largest gap 9.4e-04 (step 41 of 60)"
    assert loss_gap({"a": base, "b": base[:50]}) == "runs of 60 and 50 steps"
    stock = dict(STOCK, plan={"t": "table_wise"}, train_logloss=0.5, eval={"auc": float("nan"), "logloss": 0.5})
    herald = dict(HERALD, plan={"t": "herald"}, train_logloss=0.50003, eval={"auc": float("nan"), "logloss": 0.5})
    assert "| train logloss (mean of the last 2 steps) | 0.5000 | 0.5000 | +3.0e-05 |" in \
        format_comparison_table({"tw": stock, "herald": herald})  # (metrics.json's figures: runs of 10 steps)
    table = format_comparison_table({"tw": stock, "herald": herald}, {"tw": base, "herald": off})
    mean_base, mean_off = sum(base[-12:]) / 12, sum(off[-12:]) / 12  # (the last fifth of 60 steps, from the curves)
    assert (f"| train logloss (mean of the last 12 steps) | {mean_base:.4f} | {mean_off:.4f} | "
            f"{mean_off - mean_base:+.4f} |") in table
    assert "| per-step train logloss, last run vs first |  |  | largest gap 9.4e-04 (step 41 of 60) |" in table
    paths = write_comparison(tmp_path, {"tw": stock, "herald": herald}, {"tw": base, "herald": off}, table)
    data = json.loads(paths["json"].read_text(), parse_constant=lambda c: pytest.fail(f"{c} in comparison.json"))
    assert data["runs"]["tw"]["summary"]["eval_auc"] is None and not math.isnan(data["runs"]["tw"]["summary"]["eval_logloss"])


def test_runs_of_different_lengths_are_compared_over_the_same_last_steps_and_drawn_with_one_running_mean(
        tmp_path: Path) -> None:
    """Input skipping trains fewer steps: the table averaged the last 40 steps of one run against the last 35 of the
    other, and the figure's "running mean of 4" held for one curve of two."""
    from torchrec_herald.report import format_comparison_table

    base, short = [0.5] * 190 + [0.4] * 10, [0.5] * 167 + [0.4] * 10
    stock = dict(STOCK, plan={"t": "table_wise"}, steps=200, train_logloss=0.475)
    skip = dict(HERALD, plan={"t": "herald"}, steps=177, train_logloss=0.4714)
    table = format_comparison_table({"tw": stock, "skip": skip}, {"tw": base, "skip": short})
    assert "| train logloss (mean of the last 35 steps) | 0.4714 | 0.4714 | +0.0000 |" in table
    assert "| per-step train logloss, last run vs first |  |  | runs of 200 and 177 steps |" in table


def test_the_tables_print_counts_and_rates_as_counts_and_a_single_run_names_its_plan() -> None:
    from torchrec_herald.report import format_comparison_table, format_metrics_table

    stock = dict(STOCK, plan={"t": "table_wise"}, train_logloss=0.5, samples_per_s=34_419.6)
    table = format_comparison_table({"tw": stock, "herald": dict(HERALD, plan={"t": "herald"}, train_logloss=0.5)})
    assert "| embedding vectors per step | 13,000 | 1,750 | 0.135× (-86.5 %) |" in table
    assert "| samples/s | 34,420 | 20,000 |" in table
    assert "| KiB sent per step (all ranks) | 1,093.8 | 400.4 |" in table
    one = dict(stock, local_batch_size=256, step_time_s={"p50": 0.01, "p90": 0.02}, train_logloss_first=0.7,
               traffic_per_step={}, link_decision={"predicted": {"herald": {"step_ms": 5.5}, "table_wise": {"step_ms": 2.1}},
                                                   "chosen": "table_wise", "measured": {"link_mbit": 4063.0}})
    single = format_metrics_table(one)
    assert "| plan | 1×table_wise |" in single and "| samples/s | 34,420 |" in single
    assert "herald 5.5, TW 2.1 -> TW (measured link 4,063 Mbit/s) |" in single


def test_a_prediction_for_a_given_link_is_not_compared_with_the_step_on_the_real_one() -> None:
    from torchrec_herald.report import predicted_step_cell

    pred = {"herald": {"step_ms": 9.0, "extra_ms": 1.0, "comm_ms": 2.0, "link_busy_ms": 8.0}}
    b = {"step": 15.6, "compute": 12.0}
    given = {"link_decision": {"predicted": pred, "chosen": "herald", "link_mbit": 200.0,
                               "measured": {"link_mbit": 4979.0}}, "step_time_breakdown_ms": b}
    cell = predicted_step_cell(given)
    assert cell.endswith("on the given 200 Mbit/s (measured 15.6 on the real link, 4,979 Mbit/s measured)") and "%" not in cell
    measured = {"link_decision": {"predicted": pred, "chosen": "herald", "measured": {"link_mbit": 200.0}},
                "step_time_breakdown_ms": b}
    assert predicted_step_cell(measured).endswith("(measured 15.6, " + predicted_step_cell(measured).split(", ")[-1])
    assert "%" in predicted_step_cell(measured)


def test_one_rank_draws_no_empty_traffic_axis(tmp_path: Path) -> None:
    """At one rank nothing is sent: the traffic panels drew an axis from -0.04 to 0.04 (and matplotlib warned)."""
    import warnings

    from torchrec_herald.report import plot_training, write_comparison

    zero = _metrics({}, untagged=0.0, vectors=0.0, samples_per_s=10_000.0)
    one = dict(zero, world_size=1, plan={"t": "table_wise"})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        write_comparison(tmp_path, {"tw": one, "herald": dict(one)}, {"tw": [0.5] * 20, "herald": [0.5] * 20}, "|")
        plot_training(tmp_path, [0.5] * 20, one)
    assert (tmp_path / "training.png").stat().st_size > 10_000


def test_benchmark_plot_is_drawn_from_the_saved_rows(tmp_path: Path) -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_traffic", Path(__file__).parents[1] / "benchmarks/bench_traffic.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)  # type: ignore[union-attr]
    rows = json.loads((Path(__file__).parents[1] / "benchmarks/results/traffic.json").read_text())["rows"]
    assert all(r["config"] in bench.SHORT for r in rows)  # every configuration has a short label
    assert max(len(v) for v in bench.SHORT.values()) <= 24
    bench.plot(rows, tmp_path / "traffic.png")
    assert (tmp_path / "traffic.png").stat().st_size > 20_000


def test_a_run_folder_that_cannot_be_made_is_named_before_hydra_starts(tmp_path: Path, monkeypatch: Any) -> None:
    """A folder given, or the default ``outputs/<run id>`` (a file named ``outputs`` in the working directory), or
    the fixed part of a folder named by an interpolation: Hydra made them with a traceback of its own."""
    from torchrec_herald.train import check_overrides

    with pytest.raises(ValueError, match=r"^hydra\.run\.dir=/proc/herald_out cannot be made: /proc/herald_out \(.+\); "
                                         r"give a writable directory \(hydra\.run\.dir=<folder>\)$"):
        check_overrides(["hydra.run.dir=/proc/herald_out"])
    check_overrides([f"hydra.run.dir={tmp_path}/run"])
    assert (tmp_path / "run").is_dir()
    monkeypatch.chdir(tmp_path)
    (tmp_path / "outputs").write_text("")
    with pytest.raises(ValueError, match=r"^the run folder \(outputs/<run id>\) cannot be made: outputs \(File exists\); "
                                         r"give a writable directory \(hydra\.run\.dir=<folder>\)$"):
        check_overrides([])
    with pytest.raises(ValueError, match=rf"^hydra\.run\.dir={tmp_path}/outputs/\$\{{now:%H\}} cannot be made: "
                                         rf"{tmp_path}/outputs \(File exists\)"):
        check_overrides([f"hydra.run.dir={tmp_path}/outputs/${{now:%H}}"])
    check_overrides([f"hydra.run.dir={tmp_path}/runs/${{now:%H}}"])
    assert (tmp_path / "runs").is_dir()


def test_a_run_folder_that_exists_but_takes_no_file_is_named_before_hydra_starts(tmp_path: Path) -> None:
    """A read-only folder, or one on a full disk: it exists, so making it passed, and Hydra's traceback followed."""
    import subprocess

    from torchrec_herald.train import check_overrides

    small = tmp_path / "small"
    small.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1M", "tmpfs", str(small)], capture_output=True).returncode:
        pytest.skip("mounting a small tmpfs needs root")
    try:
        (small / "out").mkdir()
        (small / "fill").write_bytes(bytes((1 << 20) - (32 << 10)))  # (the disk nearly full)
        with pytest.raises(ValueError, match=rf"^hydra\.run\.dir={small}/out takes no file: {small}/out \(No space "
                                             rf"left on device\); give a writable directory \(hydra\.run\.dir=<folder>\)$"):
            check_overrides([f"hydra.run.dir={small}/out"])
        assert sorted(p.name for p in (small / "out").iterdir()) == []  # (the probe's file removed)
    finally:
        subprocess.run(["umount", str(small)], check=False)


def test_runs_started_alone_get_folders_of_their_own_and_a_jobs_ranks_share_one(monkeypatch: Any) -> None:
    """Two runs started in the same second shared one folder (one wrote over the other's figures and logs), and the
    ranks of one torchrun job each read their own clock for it."""
    import os
    import subprocess
    import sys

    from torchrec_herald.train import job_run_id

    monkeypatch.delenv("LOCAL_RANK", raising=False)
    mine = job_run_id()
    assert mine is not None and mine.endswith(f"_{os.getpid()}")
    code = "from torchrec_herald.train import job_run_id; print(job_run_id())"
    env = dict(os.environ, LOCAL_RANK="0")  # a rank torchrun started: named by its starter, this process
    ranks = {subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True).stdout.strip()
             for _ in range(2)}
    assert len(ranks) == 1 and ranks.pop() == mine
    alone = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            env={k: v for k, v in os.environ.items() if k != "LOCAL_RANK"}).stdout.strip()
             for _ in range(2)]
    assert alone[0] != alone[1] != mine


@pytest.mark.parametrize("env, named_by_the_rendezvous", [
    ({"TORCHELASTIC_RUN_ID": "job42", "WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8"}, True),
    ({"TORCHELASTIC_RUN_ID": "job42", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "8"}, False),
    ({"TORCHELASTIC_RUN_ID": "none", "WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8"}, False)])
def test_a_jobs_ranks_on_several_hosts_share_the_folder_named_by_its_rendezvous(
        monkeypatch: Any, env: Dict[str, str], named_by_the_rendezvous: bool) -> None:
    """Each host's torchrun agent has its own pid and start time: a job on two hosts wrote two run folders, only
    rank 0's with the figures. Across hosts the rendezvous id (``--rdzv-id``) names the folder; on one host, or
    without an id (torchrun's ``none``), the agent's start time and pid, as before."""
    import os

    from torchrec_herald.train import job_run_id

    monkeypatch.delenv("LOCAL_RANK", raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    got = job_run_id()
    assert (got == "job42") if named_by_the_rendezvous else (got is not None and got.endswith(f"_{os.getpid()}"))


@pytest.mark.parametrize("argv", [["--cfg", "job"], ["-c", "job", "batch_size=64"], ["--info", "config"],
                                  ["-m", "batch_size=64,128", "planner=herald,table_wise"],
                                  ["-m", "data.num_train_batches=range(2,4)"], ["-m", "optimizer.lr=interval(0.1,1)"],
                                  ["-m", "planner=glob(*)"]])
def test_hydras_own_flags_and_a_multiruns_sweeps_pass_the_early_check(argv: List[str]) -> None:
    """``--cfg job`` and friends are Hydra's; a multirun's sweep values are checked by their first value (each
    was refused: 'missing EQUAL', 'Ambiguous value ... add --multirun')."""
    from torchrec_herald.train import check_overrides

    check_overrides(argv)


def test_a_multiruns_bad_key_still_fails_the_early_check() -> None:
    from hydra.errors import ConfigCompositionException

    from torchrec_herald.train import check_overrides

    with pytest.raises(ConfigCompositionException, match="planer"):
        check_overrides(["-m", "planer=herald,table_wise"])


def test_tables_that_no_plan_can_hold_fail_in_preflight_naming_them_and_the_key(tmp_path: Path, monkeypatch: Any
                                                                                ) -> None:
    """A table of 10 billion rows failed in TorchRec's planner, after the model was built, with a line about shard
    storage naming neither the table nor the key: the tables with their optimizer state are checked against the
    memory TorchRec's Topology gives every rank (128 GiB of DDR a CPU rank here) first."""
    from torchrec_herald.data import synthetic

    monkeypatch.setattr(synthetic, "host_memory_bytes", lambda: 2**40)  # (a host of 1 TiB: the Topology's bound)
    csv = tmp_path / "t.csv"
    csv.write_text("label,item,tags\n" + "1,3,1\n" * 4)
    common = ["data=columnar", f"data.paths={csv}", "data.sparse={item:10000000000,tags:50}", "eval=false"]
    need = (10_000_000_000 + 50) * (16 * 4 + 4) / 2**30
    assert _error(common) == (
        f"ValueError: the embedding tables need {need:,.1f} GiB with their optimizer state at dim 16 (largest item: "
        f"10,000,000,000 rows, tags: 50 rows; data.sparse.<column>), more than the 1 rank(s)' 128 GiB (TorchRec's "
        f"Topology: HBM + DDR a rank): lower the tables' sizes or add ranks")
    assert _error(["data=columnar", f"data.paths={csv}", "data.sparse={item:1000000,tags:50}", "eval=false",
                   "batch_size=2"]) == "no error"


def test_tables_past_the_hosts_memory_fail_in_preflight_though_the_topology_holds_them(tmp_path: Path,
                                                                                         monkeypatch: Any) -> None:
    """Tables of 13 GiB on a host of 8 passed the check (the Topology's 128 GiB of DDR a rank) and failed in the
    allocator with a line naming no key, or in the OOM killer with none: on CPUs the ranks of a host share its
    memory."""
    from torchrec_herald.data import synthetic

    import torch

    monkeypatch.setattr(synthetic, "host_memory_bytes", lambda: 8 * 2**30)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # (on a GPU host the tables are in HBM)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    csv = tmp_path / "t.csv"
    csv.write_text("label,item\n" + "1,3\n" * 4)
    common = ["data=columnar", f"data.paths={csv}", "eval=false", "batch_size=2"]
    assert _error(common + ["data.sparse={item:200000000}"]) == (
        "ValueError: the embedding tables need 12.7 GiB with their optimizer state at dim 16 (largest item: 200,000,000 "
        "rows; data.sparse.<column>), more than the 7.0 GiB this host's 8 GiB of memory leave(s) for tables beside its "
        "2 rank(s)' 0.5 GiB each (runtime): lower the tables' sizes or add ranks")
    assert _error(common + ["data.sparse={item:100000000}"]) == "no error"  # (6.3 GiB)
    assert _error(common + ["data.sparse={item:115000000}"]).startswith(  # (8 GiB less 2 runtimes refuses it)
        "ValueError: the embedding tables need 7.3 GiB with their optimizer state at dim 16")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")  # two hosts of one rank each: 16 GiB
    assert _error(common + ["data.sparse={item:200000000}"]) == "no error"
    monkeypatch.delenv("LOCAL_WORLD_SIZE")  # a launcher that does not say how many ranks a host holds: not capped
    assert _error(common + ["data.sparse={item:200000000}"]) == "no error"


def test_a_setting_of_another_group_option_is_named_with_the_option_it_belongs_to() -> None:
    """``pipeline.window=3`` with the default pipeline: Hydra's message asked for ``+pipeline.window=3``, which then
    failed as an unknown key. Both now say which option the key belongs to; a key no option has keeps Hydra's."""
    from hydra.errors import ConfigCompositionException

    from torchrec_herald.train import check_overrides

    for given, message in ((["pipeline.window=3"], "pipeline.window is a setting of pipeline=herald: choose that option "
                                                    "(pipeline=herald) with it"),
                           (["data.paths=x.tsv"], "data.paths is a setting of data=criteo_tsv / data=columnar: choose "
                                                  "that option (data=criteo_tsv) with it")):
        with pytest.raises(ValueError) as e:
            check_overrides(given)
        assert str(e.value) == f"Could not override '{given[0].split('=')[0]}': {message}"
    assert _error(["+pipeline.window=3"]) == (
        "ValueError: unknown key pipeline.window: pipeline has no such key (known: name); pipeline.window is a setting "
        "of pipeline=herald: choose that option (pipeline=herald) with it")
    with pytest.raises(ConfigCompositionException, match="Could not override 'pipeline.bogus'"):
        check_overrides(["pipeline.bogus=1"])


def test_settings_nothing_reads_are_warned_and_an_approximate_mode_at_one_rank_is_refused(
        caplog: pytest.LogCaptureFixture, monkeypatch: Any) -> None:
    """A setting away from its default that nothing reads (a ``skip_*`` without ``skip``, ``move_penalty`` with the
    identity allocator, ``reference=false`` without an approximate mode, ``top_fraction`` with the cost model) was
    accepted silently: one warning each, in preflight. An approximate mode at one rank, where the model of time
    trains stock TABLE_WISE, warned only after its exact reference run had trained: refused in preflight."""
    import logging

    herald = ["planner=herald", "pipeline=herald"]
    with caplog.at_level(logging.WARNING, logger="torchrec_herald.trainer"):
        assert _error(herald + ["pipeline.skip_target=0.5", "pipeline.move_penalty=5", "pipeline.allocator=identity",
                                "pipeline.reference=false", "planner.top_fraction=0.5"]) == "no error"
    assert [r.getMessage() for r in caplog.records if r.name == "torchrec_herald.trainer"] == [
        "planner.top_fraction=0.5 is not applied: it sizes the hot set of planner.selector=top_fraction, and the "
        "selector is cost_model",
        "pipeline.skip_target=0.5 is not applied: it tunes pipeline.skip, which is null",
        "pipeline.move_penalty=5 is not applied: pipeline.allocator=identity moves no sample",
        "pipeline.reference=false is not applied: it skips the exact reference run of an approximate mode "
        "(pipeline.staleness or pipeline.skip), and none is set"]
    refused = ("ValueError: pipeline.staleness / pipeline.skip at one rank: the model of time trains stock TABLE_WISE "
               "there (no link to save on), so there is nothing to approximate; train at several ranks, or set "
               "planner.link_mbit=null to train herald's plan whatever the link")
    assert _error(herald + ["pipeline.staleness=2"]) == refused
    assert _error(herald + ["pipeline.staleness=2", "planner.link_mbit=null"]) == "no error"  # (the advice holds)
    assert _error(herald + ["pipeline.staleness=2", "planner.link_mbit=200"]) == "no error"
    caplog.clear()  # scheduling off: no scheduler reads its settings; scheduling on: no probe runs
    with caplog.at_level(logging.WARNING, logger="torchrec_herald.trainer"):
        assert _error(herald + ["pipeline.scheduling=off", "pipeline.allocator=greedy", "pipeline.sync=eager",
                                "pipeline.cache_fraction=0.5"]) == "no error"
        assert _error(herald + ["pipeline.scheduling=on", "pipeline.probe_steps=4"]) == "no error"
        monkeypatch.setenv("WORLD_SIZE", "4")  # planning by home from 3 ranks: its allocator moves no sample
        assert _error(herald + ["planner.link_mbit=null", "pipeline.move_penalty=3"]) == "no error"
        monkeypatch.delenv("WORLD_SIZE")
        assert _error(herald + ["planner.link_mbit=null", "planner.allreduce_mbit=90"]) == "no error"
    assert [r.getMessage() for r in caplog.records if r.name == "torchrec_herald.trainer"] == [
        f"pipeline.{kv} is not applied: it tunes Herald scheduling, and pipeline.scheduling=off"
        for kv in ("allocator=greedy", "sync=eager", "cache_fraction=0.5")] + [
        "pipeline.probe_steps=4 is not applied: it sizes scheduling=auto's probe, and pipeline.scheduling=on",
        "pipeline.move_penalty=3 is not applied: at 4 ranks pipeline.planning=auto plans by home, whose allocator "
        "moves no sample",
        "planner.allreduce_mbit=90 is not applied: planner.link_mbit=null keeps herald's plan whatever the link, and "
        "nothing is priced"]


def test_a_file_with_no_full_global_batch_fails_in_preflight_under_any_pipeline(tmp_path: Path) -> None:
    """A Criteo file of fewer records than one global batch failed under TorchRec's pipeline after the model was
    built and sharded ('no training step ran'); herald's pipeline caught it in preflight (its window): both now."""
    tsv = tmp_path / "small.tsv"
    tsv.write_text("\n".join([GOOD_TSV_LINE] * 10) + "\n")
    for pipeline in ([], ["planner=herald", "pipeline=herald"]):
        assert _error(["data=criteo_tsv", f"data.paths={tsv}", "eval=false", "batch_size=16"] + pipeline) == (
            f"ValueError: CriteoTSV(small.tsv) holds no full global batch of 1 × 16 samples to train (data.paths); lower "
            f"batch_size or give more data")


def test_metrics_json_is_strict_json_with_nan_figures_as_null() -> None:
    """An eval split with no batch gives NaN AUC and logloss: metrics.json held bare NaN literals, which strict JSON
    readers refuse; they are null there now (the printed table says not evaluated)."""
    from torchrec_herald.metrics import strict_json

    text = strict_json({"eval": {"auc": float("nan"), "logloss": float("inf"), "samples": 0}, "steps": [1.5, float("nan")]})
    assert json.loads(text, parse_constant=lambda c: pytest.fail(f"non-strict constant {c}")) == {
        "eval": {"auc": None, "logloss": None, "samples": 0}, "steps": [1.5, None]}


def test_a_run_shorter_than_its_checkpoint_interval_saves_its_end_and_runs_again(tmp_path: Path) -> None:
    """A run given a (new, empty) ``checkpoint.dir`` that ends before its first periodic save: it copied its
    metrics.json and losses.json there with no checkpoint, and the checkpoint-folder check then refused the same
    command. Its end is saved now, its figures beside it, and the same command reports them."""
    from torchrec_herald.dist_utils import run_multiprocess

    folder = tmp_path / "ckpt"
    folder.mkdir()
    run = ["data.num_train_batches=4", "batch_size=16", "eval=false", f"checkpoint.dir={folder}",
           "checkpoint.every_n_steps=100"]
    for attempt in ("first", "again"):
        (result,) = run_multiprocess(_train, 1, run, str(tmp_path / attempt), timeout_s=300)
        assert result["steps"] == 4 and result["steps_this_attempt"] == 4
        assert sorted(p.name for p in folder.iterdir()) == ["losses.json", "metrics.json", "step_00000004"]


def test_the_run_folder_as_checkpoint_folder_is_refused_before_training(tmp_path: Path) -> None:
    """The run writes its logs, metrics and plots into its own folder: given as ``checkpoint.dir`` too, a re-run
    (or a resume after a kill) found them among the checkpoints and was refused. Refused at the first run."""
    from torchrec_herald.trainer import run_training

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    with pytest.raises(ValueError) as e:
        run_training(compose_config(["data.num_train_batches=4", "batch_size=16", "eval=false",
                                     f"checkpoint.dir={run_dir}", "checkpoint.every_n_steps=2"]), run_dir)
    assert str(e.value) == (f"checkpoint.dir={run_dir} is the run's output folder (hydra.run.dir), where it writes its "
                            f"logs and metrics: give the checkpoints a folder of their own")


def test_the_exact_reference_of_a_tuned_skip_run_warns_of_nothing(caplog: pytest.LogCaptureFixture) -> None:
    """The exact reference of ``pipeline.skip=input pipeline.skip_target=0.5`` dropped ``skip`` but kept its tuning,
    so its preflight warned that the user's ``skip_target`` was not applied: the reference takes the defaults."""
    import logging

    from torchrec_herald.trainer import exact_reference_config

    approx = compose_config(["planner=herald", "pipeline=herald", "pipeline.skip=input", "pipeline.skip_target=0.5",
                             "planner.link_mbit=200"])
    ref = exact_reference_config(approx)
    assert ref.pipeline.skip is None and ref.pipeline.skip_target == 0.3 and approx.pipeline.skip_target == 0.5
    with caplog.at_level(logging.WARNING, logger="torchrec_herald.trainer"):
        from torchrec_herald.trainer import preflight

        preflight(ref, 2)
    assert [r.getMessage() for r in caplog.records if "not applied" in r.getMessage()] == []


def test_a_nested_key_under_a_setting_keeps_hydras_message() -> None:
    """``planner.link_mbit.a=1`` under ``planner=herald`` was told to choose planner=herald, which it had."""
    from hydra.errors import ConfigCompositionException

    from torchrec_herald.config import key_of_another_option
    from torchrec_herald.train import check_overrides

    assert key_of_another_option("planner.link_mbit.a") is None
    with pytest.raises(ConfigCompositionException, match="Could not override 'planner.link_mbit.a'"):
        check_overrides(["planner=herald", "planner.link_mbit.a=1"])


def test_the_tables_fit_check_counts_optimizer_state_only_for_rowwise_adagrad(tmp_path: Path, monkeypatch: Any
                                                                              ) -> None:
    """SGD keeps no state a row: 7e9 rows of dim 4 (104 GiB) fit the 128 GiB TorchRec's planner plans, where the
    check had counted 130 GiB with row-wise Adagrad's state and refused them."""
    from torchrec_herald.data import synthetic

    monkeypatch.setattr(synthetic, "host_memory_bytes", lambda: 2**40)
    csv = tmp_path / "t.csv"
    csv.write_text("label,item\n" + "1,3\n" * 4)
    common = ["data=columnar", f"data.paths={csv}", "data.sparse={item:7000000000}", "eval=false", "batch_size=2",
              "model.embedding_dim=4", "model.dense_arch=[8,4]"]
    assert _error(common + ["optimizer=sgd"]) == "no error"
    assert _error(common).startswith("ValueError: the embedding tables need 130.4 GiB with their optimizer state at dim 4")


def test_the_printed_decision_names_the_link_it_priced() -> None:
    """With ``planner.link_mbit=200`` the probe still times collectives (``collective_latency_ms=auto``): the table
    named the probe's 5,430 Mbit/s as 'measured link' where the model had priced the declared 200."""
    from torchrec_herald.report import decision_cell

    preds = {"herald": {"step_ms": 8.9}, "table_wise": {"step_ms": 24.2}}
    declared = {"link_decision": {"predicted": preds, "chosen": "herald", "link_mbit": 200.0,
                                  "measured": {"link_mbit": 5430.0, "collective_latency_ms": 0.22}}}
    assert decision_cell(declared) == "herald 8.9, TW 24.2 -> herald (given link 200 Mbit/s)"
    probed = {"link_decision": {**declared["link_decision"], "link_mbit": 5430.0, "chosen": "table_wise"}}
    assert decision_cell(probed) == "herald 8.9, TW 24.2 -> TW (measured link 5,430 Mbit/s)"
    # TorchRec's default plan predicted fastest, within one latency of TABLE_WISE: the cell says why TW trains
    close = {"link_decision": {"predicted": {**preds, "default": {"step_ms": 24.0}}, "chosen": "table_wise",
                               "link_mbit": 5430.0, "note": "TorchRec's default plan is predicted within ..."}}
    assert decision_cell(close) == ("herald 8.9, TW 24.2, default plan 24.0 -> TW (given link 5,430 Mbit/s; the "
                                    "default plan set aside: within one collective's latency of TW)")


def test_a_run_shorter_than_the_scheduling_probe_says_no_choice_was_made(tmp_path: Path) -> None:
    """``scheduling=auto`` probes on its first steps; a run that ends before the probe decides said nothing, and its
    comparison column read 'herald + scheduling'. metrics.json (and the log) now say why no choice was made."""
    from torchrec_herald.dist_utils import run_multiprocess
    from torchrec_herald.train import run_label

    overrides = ["planner=herald", "pipeline=herald", "planner.link_mbit=20", "planner.collective_latency_ms=1",
                 "data.num_train_batches=8", "batch_size=16", "eval=false"]  # (the link declared: herald's plan by far)
    first, _ = run_multiprocess(_train, 2, overrides, str(tmp_path / "run"), timeout_s=300)
    sched = first["herald_pipeline"]["scheduling"]
    assert (sched["setting"], sched["decided"], sched["mode"]) == ("auto", False, "on")  # (8 steps: the on phase)
    assert sched["why"] == ("pipeline.scheduling=auto: the run ended before its probe's 32 steps "
                            "(pipeline.probe_steps=10) decided; no choice was made")
    assert run_label(compose_config(overrides), first) == "herald + scheduling"
    ended_off = {**first, "herald_pipeline": {"scheduling": {**sched, "mode": "off"}}}  # (ended in the off phase)
    assert run_label(compose_config(overrides), ended_off) == "herald (scheduling off: the probe did not finish)"


def test_a_runs_checks_log_into_its_own_log_file_where_they_were_lost_before(tmp_path: Path) -> None:
    """preflight logged before the run's log file was set up: its lines reached no file (and, in a compare_with job,
    the herald run's landed in the baseline's folder)."""
    from torchrec_herald.dist_utils import run_multiprocess

    run_multiprocess(_train, 2, ["data.num_train_batches=4", "batch_size=16", "eval=false"], str(tmp_path / "run"),
                     timeout_s=300)
    for rank in (0, 1):
        log = (tmp_path / "run" / "logs" / f"rank{rank}.log").read_text()
        assert log.count("building data source") == 1 and log.index("building data source") < log.index("world_size=2")


def test_a_run_folder_is_one_jobs_and_an_earlier_runs_figures_there_are_moved_aside(tmp_path: Path) -> None:
    """Two jobs given one run folder (HERALD_RUN_ID, torchx --run_id, hydra.run.dir) wrote their figures over each
    other's, one after the other or at once, and said nothing."""
    import os
    import subprocess
    import sys

    from torchrec_herald.train import claim_run_folder

    from torchrec_herald.train import set_earlier_figures_aside

    run = tmp_path / "run"
    claim_run_folder(run)
    assert set_earlier_figures_aside(run) is None  # (a new folder: nothing to move)
    code = ("import sys; from pathlib import Path; from torchrec_herald.train import claim_run_folder\n"
            "try:\n    claim_run_folder(Path(sys.argv[1]))\nexcept ValueError as e:\n    print(e)")
    other = subprocess.run([sys.executable, "-c", code, str(run)], capture_output=True, text=True, timeout=120)
    assert other.stdout.startswith(f"run folder {run} is in use by another job (pid {os.getpid()} on "), other
    assert other.stdout.rstrip().endswith("give this one a folder of its own (torchx --run_id, HERALD_RUN_ID or "
                                          "hydra.run.dir), or run it once that one ends")
    for name in ("metrics.json", "losses.json", "comparison.png"):
        (run / name).write_text(name)
    (run / "baseline_table_wise" / "logs").mkdir(parents=True)
    (run / "logs").mkdir()
    later = subprocess.run([sys.executable, "-c", code, str(run)], capture_output=True, text=True, timeout=120)
    assert "in use" in later.stdout  # (this process still holds it)
    from torchrec_herald.train import _RUN_FOLDER_LOCK

    os.close(_RUN_FOLDER_LOCK.pop())  # (as this job's end lets it go)
    claim_run_folder(run)
    aside = set_earlier_figures_aside(run)
    assert aside is not None and aside.parent == run and aside.name.startswith("earlier-")
    assert sorted(p.name for p in aside.iterdir()) == ["baseline_table_wise", "comparison.png", "losses.json",
                                                       "metrics.json"]
    assert (aside / "metrics.json").read_text() == "metrics.json" and (run / "logs").is_dir()
    os.close(_RUN_FOLDER_LOCK.pop())


def test_a_run_that_fails_its_checks_leaves_its_log_lines_in_its_own_folder_and_none_for_the_next(
        tmp_path: Path) -> None:
    """A failed run's held log lines stayed in the process and were written at the top of the next run's log; its
    own folder explained nothing."""
    from torchrec_herald.dist_utils import run_multiprocess

    (failure,) = run_multiprocess(_train_twice, 1, [["data.num_train_batches=0"],
                                                    ["data.num_train_batches=2", "eval=false", "batch_size=16"]],
                                  str(tmp_path), timeout_s=300)
    assert failure == "data.num_train_batches=0 leaves nothing to train; give at least 1"
    failed = (tmp_path / "run0" / "logs" / "rank0.log").read_text()
    assert failed.count("building data source") == 1
    after = (tmp_path / "run1" / "logs" / "rank0.log").read_text()
    assert after.count("building data source") == 1 and after.index("building data source") < after.index("world_size=1")


def _train_twice(rank: int, world: int, runs: List[List[str]], folder: str) -> Any:
    from torchrec_herald.trainer import run_training

    first, second = runs
    try:
        run_training(compose_config(first), Path(folder) / "run0", show_progress=False)
    except ValueError as e:
        run_training(compose_config(second), Path(folder) / "run1", show_progress=False)
        return str(e)
    return "the first run did not fail"


def test_a_baseline_of_the_runs_own_planner_keeps_its_planner_keys() -> None:
    """``compare_with=herald planner.link_mbit=200``: the baseline dropped every ``planner.*`` key, probed the link
    and trained TABLE_WISE where the run priced the stated 200 Mbit/s; a stock baseline has no such keys."""
    from torchrec_herald.train import baseline_overrides

    task = ["planner=herald", "pipeline=herald", "planner.link_mbit=200", "+planner.x=1", "compare_with=herald",
            "batch_size=64"]
    assert baseline_overrides(task, "herald", "herald") == ["batch_size=64", "planner.link_mbit=200", "+planner.x=1",
                                                            "planner=herald"]
    assert baseline_overrides(task, "herald", "table_wise") == ["batch_size=64", "planner=table_wise"]


def test_on_a_gpu_the_table_says_nccls_communication_is_in_compute_and_predicts_nothing() -> None:
    """NCCL's collectives never block the host: on a GPU the step's ``comm_wait`` misses them and ``compute`` holds
    them, so the model's link part added to that compute counted the communication twice."""
    from torchrec_herald.report import breakdown_cell, predicted_step_cell

    d = {"predicted": {"herald": {"extra_ms": 1.0, "comm_ms": 2.0, "link_busy_ms": 1.5, "step_ms": 3.0}},
         "chosen": "herald", "link_mbit": 5000.0, "measured": {"link_mbit": 5000.0, "collective_latency_ms": 0.2}}
    b = {"step": 10.0, "compute": 9.0, "comm_wait": 1.0, "scheduler_critical": 0.0, "scheduler_overlapped": 0.5}
    cpu = {"link_decision": d, "step_time_breakdown_ms": b, "comm_wait_host_only": False}
    gpu = {**cpu, "comm_wait_host_only": True}
    assert breakdown_cell(cpu) == "10.0 = 9.0 + 1.0 + 0.0 (ahead 0.5)"
    assert breakdown_cell(gpu) == ("10.0 = 9.0 + 1.0 + 0.0 (ahead 0.5) (NCCL's communication does not block the host: "
                                   "it is in compute)")
    assert predicted_step_cell(cpu) == "12.0 (measured 10.0, +20 %)"
    assert predicted_step_cell(gpu) == "– (NCCL's communication is in this run's compute on the host's clock)"


def test_the_measured_wait_for_late_peers_is_shown_in_the_breakdown_and_on_the_predicted_steps_critical_path() -> None:
    from torchrec_herald.report import breakdown_cell, predicted_step_cell

    d = {"predicted": {"herald": {"extra_ms": 1.0, "comm_ms": 2.0, "link_busy_ms": 1.5, "step_ms": 3.0}},
         "chosen": "herald", "link_mbit": 5000.0, "measured": {"link_mbit": 5000.0, "collective_latency_ms": 0.2}}
    b = {"step": 10.0, "compute": 8.0, "comm_wait": 2.0, "scheduler_critical": 0.0, "scheduler_overlapped": 0.0,
         "peer_wait": 0.8}
    m = {"link_decision": d, "step_time_breakdown_ms": b, "comm_wait_host_only": False, "peer_wait_steps": 200}
    assert breakdown_cell(m) == "10.0 = 8.0 + 2.0, 0.8 of it for late peers over 200 steps + 0.0 (ahead 0.0)"
    # 8.0 compute + 1.0 extra + 2.0 comm + 0.8 waited for peers (the link's 1.5 busy is shorter)
    assert predicted_step_cell(m) == "11.8 (measured 10.0, +18 %, with 0.8 measured for late peers)"
    unmeasured = {**m, "step_time_breakdown_ms": {**b, "peer_wait": None}}
    assert breakdown_cell(unmeasured) == "10.0 = 8.0 + 2.0 + 0.0 (ahead 0.0)"
    assert predicted_step_cell(unmeasured) == "11.0 (measured 10.0, +10 %)"
