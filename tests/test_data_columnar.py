"""Tests of the Parquet / CSV columnar source."""

from pathlib import Path
from typing import Any, Dict, List

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from omegaconf import OmegaConf

from torchrec_herald.data import ColumnarSource, DataFormatError, build_data_source

from torchrec_herald.data.config import DATA_CONFIGS
from torchrec_herald.data.files import shown
COLUMNS: Dict[str, Any] = {"label": "y", "dense": ["d0", "d1"], "sparse": {"item": 10, "tags": 7}}

CSV_ROWS = [
    "id,y,d0,d1,item,tags",  # 'id' is not used
    "a,1,0.5,2,3,1|2|9",
    "b,0,,-1,,",
    "c,1,3,4,12,-1",
]


def write_csv(path: Path, rows: List[str]) -> str:
    path.write_text("\n".join(rows) + "\n")
    return str(path)


def write_parquet(path: Path, **columns: Any) -> str:
    pq.write_table(pa.table(columns), path, row_group_size=2)
    return str(path)


def expected_parquet(path: Path) -> str:
    return write_parquet(
        path,
        y=pa.array([1, 0, 1], pa.int8()),
        d0=[0.5, None, 3.0],
        d1=[2.0, -1.0, 4.0],
        item=pa.array([3, None, 12], pa.int64()),
        tags=pa.array([[1, 2, 9], [], [-1]], pa.list_(pa.int64())),
    )


def check_expected(src: ColumnarSource) -> None:
    (b,) = list(src.train_batches(0, 1, 3))
    assert b.labels.tolist() == [1.0, 0.0, 1.0]
    assert torch.equal(b.dense_features, torch.tensor([[0.5, 2.0], [0.0, -1.0], [3.0, 4.0]]))
    kjt = b.sparse_features
    assert kjt.keys() == ["item", "tags"] == src.feature_names and src.num_embeddings == [10, 7]
    assert kjt.lengths().tolist() == [1, 0, 1, 3, 0, 1]
    assert kjt.values().tolist() == [3, 12 % 10, 1, 2, 9 % 7, -1 % 7] == [3, 2, 1, 2, 2, 6]


def test_csv_exact(tmp_path: Path) -> None:
    path = write_csv(tmp_path / "t.csv", CSV_ROWS)
    check_expected(ColumnarSource(path, eval_paths=path, **COLUMNS))


def test_parquet_exact(tmp_path: Path) -> None:
    path = expected_parquet(tmp_path / "t.parquet")
    check_expected(ColumnarSource(path, eval_paths=path, **COLUMNS))


def test_log1p_dense_and_format_key(tmp_path: Path) -> None:
    path = write_csv(tmp_path / "t.data", CSV_ROWS)
    with pytest.raises(ValueError) as e:
        ColumnarSource(path, **COLUMNS)
    assert str(e.value) == (f"{path}: cannot infer the format from its suffix (known: ['.csv', '.csv.gz', '.parquet', "
                            f"'.pq']); set data.format=csv or data.format=parquet")
    src = ColumnarSource(path, eval_paths=path, format="csv", log1p_dense=True, **COLUMNS)
    (b,) = list(src.train_batches(0, 1, 3))
    assert torch.equal(b.dense_features, torch.tensor([[0.5, 2.0], [0.0, 0.0], [3.0, 4.0]]).log1p())


def test_out_of_range_id_without_hashing(tmp_path: Path) -> None:
    path = write_csv(tmp_path / "t.csv", CSV_ROWS)
    src = ColumnarSource(path, eval_paths=path, hash_ids=False, **COLUMNS)
    with pytest.raises(DataFormatError) as err:
        list(src.train_batches(0, 1, 3))
    assert str(err.value) == f"{path}:2: column 'tags': id 9 out of range for a table of 7 rows (hash_ids is false)"
    ppath = expected_parquet(tmp_path / "t.parquet")
    with pytest.raises(DataFormatError) as err:
        list(ColumnarSource(ppath, eval_paths=ppath, hash_ids=False, **COLUMNS).train_batches(0, 1, 3))
    assert str(err.value) == f"{ppath}:row 1: column 'tags': id 9 out of range for a table of 7 rows (hash_ids is false)"
    # in-range ids pass unchanged; negative ids are out of range too
    ok = write_csv(tmp_path / "ok.csv", ["y,d0,d1,item,tags", "1,0,0,9,6|0", "0,0,0,0,-1"])
    src = ColumnarSource(ok, eval_paths=ok, hash_ids=False, **COLUMNS)
    with pytest.raises(DataFormatError, match=r"ok.csv:3: column 'tags': id -1 out of range for a table of 7 rows"):
        list(src.train_batches(0, 1, 2))
    src.on_error = "skip"
    (b,) = list(src.train_batches(0, 1, 1))
    assert b.sparse_features.values().tolist() == [9, 6, 0] and src.stats()["skipped_lines"] == 1


@pytest.mark.parametrize(
    "row, problem",
    [
        ("a,1,0.5,2", "expected 6 comma-separated fields, got 4"),
        ("a,2,0,0,1,1", "column 'y': label must be 0 or 1, got '2'"),
        ("a,,0,0,1,1", "column 'y': label must be 0 or 1, got ''"),
        ("a,1,x,0,1,1", "column 'd0': expected a finite number, got 'x'"),
        ("a,1,0,nan,1,1", "column 'd1': expected a finite number, got 'nan'"),
        ("a,1,0,0,1.5,1", "column 'item': expected integer id(s), got '1.5'"),
        ("a,1,0,0,1,3|", "column 'tags': expected integer id(s), got '3|'"),
        ("a,1,1e300,0,1,1", "column 'd0': '1e300' overflows float32, the dense features' type (largest 3.403e+38)"),
        ("a,1,0,0,1," + "1|" * 70000 + "1", f"field larger than field limit ({131072}): a field of more than 131072 "
                                            "characters (a long multi-hot list); give such data as Parquet"),
    ],
)
def test_csv_malformed_rows(tmp_path: Path, row: str, problem: str) -> None:
    path = write_csv(tmp_path / "t.csv", CSV_ROWS[:2] + [row] + CSV_ROWS[2:])
    with pytest.raises(DataFormatError) as err:
        list(ColumnarSource(path, eval_paths=path, **COLUMNS).train_batches(0, 1, 1))
    assert str(err.value) == f"{path}:3: {problem}"
    src = ColumnarSource(path, eval_paths=path, on_error="skip", **COLUMNS)
    check_expected(src)
    assert src.stats()["skipped_lines"] == 1


def test_parquet_malformed_and_skip(tmp_path: Path) -> None:
    path = write_parquet(
        tmp_path / "t.parquet",
        y=[1, None, 0, 1, 0],
        d0=[1.0, 2.0, 3.0, 4.0, 5.0],
        d1=[0.0] * 5,
        item=[1, 2, 3, 4, 5],
        tags=pa.array([[1], [2], [None], [4], None], pa.list_(pa.int64())),
    )
    with pytest.raises(DataFormatError) as err:
        list(ColumnarSource(path, eval_paths=path, **COLUMNS).train_batches(0, 1, 1))
    assert str(err.value) == f"{path}:row 2: column 'y': label must be 0 or 1, got None"
    src = ColumnarSource(path, eval_paths=path, on_error="skip", **COLUMNS)
    batches = list(src.train_batches(0, 1, 2))
    assert [b.dense_features[:, 0].tolist() for b in batches] == [[1.0, 4.0]]
    assert src.stats() == {
        "skipped_lines": 2, "dropped_tail_samples": 1,
        "train_dropped_tail_samples": 1, "eval_dropped_tail_samples": 0,
    }  # fmt: skip


def test_missing_column_raises_even_when_skipping(tmp_path: Path) -> None:
    path = write_csv(tmp_path / "t.csv", ["y,d0,d1,item", "1,0,0,1"])
    with pytest.raises(DataFormatError, match=r"t.csv:1: missing column\(s\) \['tags'\]"):
        list(ColumnarSource(path, on_error="skip", **COLUMNS).train_batches(0, 1, 1))


def test_rank_slices_tail_and_holdout(tmp_path: Path) -> None:
    n = 45
    path = write_parquet(
        tmp_path / "t.parquet", y=[i % 2 for i in range(n)], d0=[float(i) for i in range(n)],
        d1=[0.0] * n, item=list(range(n)), tags=[[i, i + 1] for i in range(n)],
    )  # fmt: skip
    src = ColumnarSource(path, eval_paths=path, **COLUMNS)
    whole = list(src.train_batches(0, 1, 8))
    assert src.stats()["dropped_tail_samples"] == 5
    per_rank = [list(src.train_batches(r, 2, 4)) for r in range(2)]
    assert len(whole) == len(per_rank[0]) == len(per_rank[1]) == 5
    for g, a, b in zip(whole, *per_rank):
        assert torch.equal(torch.cat([a.dense_features, b.dense_features]), g.dense_features)
        assert g.sparse_features.values().tolist() == [
            *a.sparse_features["item"].values().tolist(), *b.sparse_features["item"].values().tolist(),
            *a.sparse_features["tags"].values().tolist(), *b.sparse_features["tags"].values().tolist(),
        ]  # fmt: skip
    held = ColumnarSource(path, holdout_every=2, **COLUMNS)
    train = [x for b in held.train_batches(0, 1, 10) for x in b.dense_features[:, 0].tolist()]
    evals = [x for b in held.eval_batches(0, 1, 10) for x in b.dense_features[:, 0].tolist()]
    assert train == [*range(0, 10), *range(20, 30)] and evals == [*range(10, 20), *range(30, 40)]
    assert held.stats()["dropped_tail_samples"] == 5  # global batch 4 (train) has 5 samples


def test_config(tmp_path: Path) -> None:
    path = write_csv(tmp_path / "t.csv", CSV_ROWS)
    cfg = OmegaConf.structured(DATA_CONFIGS["columnar"])
    cfg.paths, cfg.label, cfg.dense, cfg.sparse = path, "y", ["d0", "d1"], {"item": 10, "tags": 7}
    cfg.eval_paths = path
    src = build_data_source(cfg)
    assert isinstance(src, ColumnarSource) and src.num_dense == 2 and src.hash_ids
    check_expected(src)
    with pytest.raises(ValueError, match=r"data source 'columnar': unknown config key\(s\) \['hash'\]"):
        build_data_source({"name": "columnar", "paths": path, "sparse": {"item": 10}, "hash": False})
    with pytest.raises(ValueError, match="format"):
        build_data_source({"name": "columnar", "paths": path, "sparse": {"item": 10}, "format": "orc"})


def test_the_readmes_command_line_sparse_override_composes_and_a_bad_one_names_the_key() -> None:
    from hydra import compose, initialize_config_module

    import torchrec_herald.config  # noqa: F401  (registers the groups)

    base = ["data=columnar", "data.paths=clicks.csv", "data.label=clicked"]
    with initialize_config_module(config_module="torchrec_herald.conf", version_base=None):
        cfg = compose("train", overrides=[*base, "data.sparse={user_id: 100000, item_id: 50000, category: 1000}"])
        assert dict(cfg.data.sparse) == {"user_id": 100000, "item_id": 50000, "category": 1000}
        bad = compose("train", overrides=[*base, "data.sparse={user_id: abc}"])
        listed = compose("train", overrides=[*base, "data.sparse=[1,2]"])
    with pytest.raises(ValueError, match=r"^data\.sparse: each table size must be an integer, got \{'user_id': 'abc'\}$"):
        build_data_source(bad.data)
    with pytest.raises(ValueError, match=r"^data\.sparse must map at least one sparse column to its table size"):
        build_data_source(listed.data)
    with pytest.raises(ValueError, match=r"^data\.sparse: each table size must be >= 1, got \{'cat': 0\}$"):
        build_data_source({"name": "columnar", "paths": "clicks.csv", "sparse": {"user": 50, "cat": 0}})


def test_a_byte_order_mark_is_dropped_and_a_column_named_twice_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "t.csv"
    path.write_text("\ufeff" + "\n".join(CSV_ROWS) + "\n", encoding="utf-8")
    check_expected(ColumnarSource(str(path), eval_paths=str(path), **COLUMNS))
    twice = write_csv(tmp_path / "twice.csv", ["y,d0,d1,item,tags,item", "1,0,0,1,2,3"])
    with pytest.raises(DataFormatError, match=r"twice.csv:1: column\(s\) \['item'\] appear more than once in the header"):
        ColumnarSource(twice, **COLUMNS).check()


def test_a_file_that_is_not_parquet_is_named(tmp_path: Path) -> None:
    path = tmp_path / "t.parquet"
    path.write_text("y,d0\n1,2\n")
    with pytest.raises(DataFormatError, match=r"t.parquet:after record 0: the file cannot be read on: ArrowInvalid: "):
        ColumnarSource(str(path), **COLUMNS).check()


def test_a_dense_value_beyond_float32_is_accepted_where_log1p_brings_it_in(tmp_path: Path) -> None:
    """``log1p_dense`` makes 1e300 about 690: it trains as a finite number, so it is not refused."""
    path = write_csv(tmp_path / "t.csv", CSV_ROWS[:1] + ["a,1,1e300,2,3,1"] * 2)
    (b,) = list(ColumnarSource(path, eval_paths=path, log1p_dense=True, **COLUMNS).train_batches(0, 1, 2))
    assert torch.isfinite(b.dense_features).all() and float(b.dense_features[0, 0]) == pytest.approx(690.7755, rel=1e-6)


@pytest.mark.parametrize("on_error", ["raise", "skip"])
def test_an_unmatched_quote_is_named_at_its_line_whatever_on_error_says(tmp_path: Path, on_error: str) -> None:
    """A stray '"' took every later line into one record: on_error=skip trained 50 of 199 good rows and counted
    one skipped line, and on_error=raise named the file's last line."""
    rows = ["y,d0,d1,item,tags"] + [f"{i % 2},{i},0,{i % 10},1" for i in range(200)]
    rows[51] = '1,"50,0,0,1'
    path = write_csv(tmp_path / "t.csv", rows)
    with pytest.raises(DataFormatError) as err:
        list(ColumnarSource(path, eval_paths=path, on_error=on_error, **COLUMNS).train_batches(0, 1, 10))
    assert str(err.value) == (f"{path}:52: a quoted field opened on this line runs to line 201, taking 150 lines into one "
                              f"record (expected 5 comma-separated fields, got 2): an unmatched '\"'?")

def test_a_quoted_field_over_several_lines_is_one_record_and_said_once(tmp_path: Path,
                                                                        caplog: pytest.LogCaptureFixture) -> None:
    rows = ["y,d0,d1,item,tags,note"] + [f"{i % 2},{i},0,{i % 10},1,x" for i in range(6)]
    rows[2], rows[4] = '1,1,0,1,1,"a\nb"', '1,3,0,3,1,"c\nd"'
    path = write_csv(tmp_path / "t.csv", rows)
    with caplog.at_level("WARNING"):
        (b,) = list(ColumnarSource(path, eval_paths=path, **COLUMNS).train_batches(0, 1, 6))
    assert b.dense_features[:, 0].tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    assert [r.getMessage() for r in caplog.records] == [
        f"{path}:3: a quoted field runs from this line to line 4 (one record of 2 lines)"]


def test_an_id_written_as_a_whole_float_reads_and_one_int_would_misread_is_refused(tmp_path: Path) -> None:
    """pandas writes an int column with missing values as '3.0'; int() read '1_3' as id 13, and a bool column as
    ids 0 and 1."""
    path = write_csv(tmp_path / "t.csv", ["y,d0,d1,item,tags", "1,0,0,3.0,4"])
    (b,) = list(ColumnarSource(path, eval_paths=path, **COLUMNS).train_batches(0, 1, 1))
    assert b.sparse_features.values().tolist() == [3, 4]
    for cell in ("1_3", " 3"):
        bad = write_csv(tmp_path / "bad.csv", ["y,d0,d1,item,tags", f"1,0,0,{cell},4"])
        with pytest.raises(DataFormatError, match=rf"bad\.csv:2: column 'item': expected integer id\(s\), got '{cell}'"):
            list(ColumnarSource(bad, eval_paths=bad, **COLUMNS).train_batches(0, 1, 1))
    flags = write_parquet(tmp_path / "b.parquet", y=[1], d0=[0.0], d1=[0.0], item=[True], tags=[1])
    with pytest.raises(DataFormatError, match=r"b\.parquet:row 1: column 'item': expected integer id\(s\), got True"):
        list(ColumnarSource(flags, eval_paths=flags, **COLUMNS).train_batches(0, 1, 1))


def test_a_file_without_records_among_others_is_passed_over_and_alone_is_refused(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Spark writes a header-only part (or a zero-row Parquet one) for an empty partition: such a file was refused,
    so a Spark output folder could not be given."""
    head = write_csv(tmp_path / "part-0.csv", CSV_ROWS[:1])
    full = write_csv(tmp_path / "part-1.csv", CSV_ROWS)
    empty_pq = write_parquet(tmp_path / "part-2.parquet", y=pa.array([], pa.int8()), d0=pa.array([], pa.float64()),
                             d1=pa.array([], pa.float64()), item=pa.array([], pa.int64()), tags=pa.array([], pa.int64()))
    src = ColumnarSource([head, full, empty_pq], eval_paths=full, **COLUMNS)
    with caplog.at_level("WARNING"):
        src.check()
    assert [r.getMessage() for r in caplog.records] == [
        f"data.paths: 2 file(s) hold no records and are passed over: {head}, {empty_pq}"]
    check_expected(src)
    with pytest.raises(DataFormatError, match=r"part-0\.csv:1: the file holds no records, nor do the other 1 file\(s\) "
                                              r"of data\.paths"):
        ColumnarSource([head, empty_pq], eval_paths=full, **COLUMNS).check()
    with pytest.raises(DataFormatError, match=r"part-0\.csv:1: the file holds no records$"):
        ColumnarSource(full, eval_paths=head, **COLUMNS).check()


def test_a_tsv_given_as_csv_names_its_columns_in_a_line_of_bounded_length(tmp_path: Path) -> None:
    path = write_csv(tmp_path / "t.csv", ["\t".join(["1"] * 14 + ["a" * 8] * 26)] * 2)
    with pytest.raises(DataFormatError) as err:
        list(ColumnarSource(path, **COLUMNS).train_batches(0, 1, 1))
    first = "\t".join(["1"] * 14 + ["a" * 8] * 26)  # one column: the whole line, cut
    assert str(err.value) == f"{path}:1: missing column(s) ['y', 'd0', 'd1', 'item', 'tags']; found [{shown(first, 40)}]"
    assert shown(first, 40).endswith("... (261 characters)")
