"""Tests of the streaming Criteo TSV reader."""

import gzip
import os
import math
import pickle
from pathlib import Path
from typing import List, Optional, Sequence

import pytest
import torch
from omegaconf import OmegaConf

from torchrec_herald.data import CriteoTSV, DataFormatError, TrainStream, build_data_source, scaled_num_embeddings

NUM_EMB = [10 + f for f in range(26)]  # a different modulus per table
from torchrec_herald.data.config import DATA_CONFIGS


def line(label: str = "1", dense: Optional[Sequence[str]] = None, cats: Optional[Sequence[str]] = None) -> str:
    dense = list(dense) if dense is not None else [str(i) for i in range(13)]
    cats = list(cats) if cats is not None else [format(i + 1, "x") for i in range(26)]
    return "\t".join([label, *dense, *cats]) + "\n"


def write(path: Path, lines: Sequence[str]) -> str:
    path.write_text("".join(lines))
    return str(path)


def numbered(n: int) -> List[str]:
    """n valid lines whose int_0 is the line index (to follow samples through batching)."""
    return [line(str(i % 2), [str(i)] + ["0"] * 12) for i in range(n)]


def sample_ids(batches) -> List[int]:
    return [round(math.expm1(x)) for b in batches for x in b.dense_features[:, 0].tolist()]


def test_parse_exact_values(tmp_path: Path) -> None:
    huge = "ff" * 40  # 320-bit id: hashing must stay exact and in range
    cats1 = ["a", "", huge] + ["1f"] * 23
    lines = [
        line("1", ["1", "-3", "", "10"] + ["0"] * 9, cats1),
        line("0", None, [""] * 26),
    ]
    path = write(tmp_path / "train.tsv", lines)
    src = CriteoTSV(path, eval_paths=path, num_embeddings=NUM_EMB)
    (b,) = list(src.train_batches(0, 1, 2))
    assert b.labels.tolist() == [1.0, 0.0]
    expected_dense = torch.tensor(
        [[1, 0, 0, 10] + [0] * 9, list(range(13))], dtype=torch.float64
    ).log1p().float()
    assert torch.equal(b.dense_features, expected_dense)
    jt = b.sparse_features.to_dict()
    assert jt["cat_0"].values().tolist() == [0xA % 10] and jt["cat_0"].lengths().tolist() == [1, 0]
    assert jt["cat_1"].values().tolist() == [] and jt["cat_1"].lengths().tolist() == [0, 0]
    assert jt["cat_2"].values().tolist() == [int(huge, 16) % 12] == [3]
    assert [jt[f"cat_{f}"].values().tolist() for f in range(3, 26)] == [[0x1F % (10 + f)] for f in range(3, 26)]
    assert b.sparse_features.lengths().tolist() == [1, 0] + [0, 0] + [1, 0] * 24
    assert src.stats()["skipped_lines"] == 0


def test_gzip_and_multiple_files_stream_as_one(tmp_path: Path) -> None:
    lines = numbered(12)
    with gzip.open(tmp_path / "a.tsv.gz", "wt") as f:
        f.writelines(lines[:5])
    second = write(tmp_path / "b.tsv", lines[5:])
    src = CriteoTSV([str(tmp_path / "a.tsv.gz"), second], eval_paths=second)
    batches = list(src.train_batches(0, 1, 4))
    assert sample_ids(batches) == list(range(12))


@pytest.mark.parametrize(
    "bad, problem",
    [
        ("1\t2\t3\n", "expected 40 tab-separated fields, got 3"),
        (line("1")[:-1] + "\t\n", "expected 40 tab-separated fields, got 41"),
        (line("x"), "field 1 (label): expected 0 or 1, got 'x'"),
        (line("1", ["0", "1.5"] + ["0"] * 11), "field 3 (int_1): expected an integer, got '1.5'"),
        (line("1", None, ["zz"] + ["0"] * 25), "field 15 (cat_0): expected a hexadecimal id, got 'zz'"),
        (line("1", None, ["0"] * 25 + ["12g"]), "field 40 (cat_25): expected a hexadecimal id, got '12g'"),
        (line("1", ["0", "9" * 400] + ["0"] * 11),
         f"field 3 (int_1): {chr(39)}{'9' * 58}{chr(39)}... (400 characters) is beyond an int64 count"),
        (line("\x00" * 100), "field 1 (label): expected 0 or 1, got '" + "\\x00" * 14 + "'... (100 characters)"),
    ],
)
def test_malformed_line_raises_with_file_and_line(tmp_path: Path, bad: str, problem: str) -> None:
    path = write(tmp_path / "train.tsv", [line(), line(), bad, line()])
    src = CriteoTSV(path, eval_paths=path)
    with pytest.raises(DataFormatError) as err:
        list(src.train_batches(0, 1, 2))
    assert str(err.value) == f"{path}:3: {problem}"
    assert isinstance(err.value, ValueError) and err.value.where == 3
    assert str(pickle.loads(pickle.dumps(err.value))) == str(err.value)


def test_error_raised_on_every_rank(tmp_path: Path) -> None:
    # line 2 belongs to rank 0's slice, yet rank 1 must fail too (ranks must agree on batches)
    path = write(tmp_path / "train.tsv", [line(), "garbage\n", line(), line()])
    with pytest.raises(DataFormatError, match=r"train.tsv:2: expected 40"):
        list(CriteoTSV(path, eval_paths=path).train_batches(1, 2, 2))


def test_skip_policy_counts_exactly(tmp_path: Path) -> None:
    lines = numbered(10)
    lines[2:2] = ["bad\n"]
    lines[6:6] = [line("2")]
    lines.append(line("1", None, ["xyz"] * 26))
    path = write(tmp_path / "train.tsv", lines)
    src = CriteoTSV(path, eval_paths=path, on_error="skip")
    batches = list(src.train_batches(0, 1, 5))
    assert sample_ids(batches) == list(range(10))
    assert src.stats() == {
        "skipped_lines": 3, "dropped_tail_samples": 0,
        "train_dropped_tail_samples": 0, "eval_dropped_tail_samples": 0,
    }  # fmt: skip
    list(src.train_batches(0, 1, 5))  # a second pass does not count the same lines again
    assert src.stats()["skipped_lines"] == 3


def test_rank_slices_and_dropped_tail(tmp_path: Path) -> None:
    path = write(tmp_path / "train.tsv", numbered(37))
    src = CriteoTSV(path, eval_paths=path)
    whole = list(src.train_batches(0, 1, 12))
    assert sample_ids(whole) == list(range(36)) and src.stats()["dropped_tail_samples"] == 1
    per_rank = [list(src.train_batches(r, 3, 4)) for r in range(3)]
    assert [sample_ids([per_rank[r][i]]) for i in range(3) for r in range(3)] == [
        list(range(s, s + 4)) for s in range(0, 36, 4)
    ]
    for i, g in enumerate(whole):
        assert torch.equal(torch.cat([per_rank[r][i].labels for r in range(3)]), g.labels)
    for start in range(4):  # seeking: the records before ``start`` are read, not yielded
        assert sample_ids(list(src.train_batches_from(1, 3, 4, start))) == sample_ids(per_rank[1][start:])
    stream = TrainStream(src, 2, 3, 4, whole=True)
    assert sample_ids([next(stream)]) == list(range(12))
    stream.whole = False
    assert sample_ids(list(stream)) == list(range(20, 24)) + list(range(32, 36))
    list(src.train_batches(0, 5, 4))  # global batch 20: one batch, 17 dropped
    assert src.stats()["train_dropped_tail_samples"] == 17


def test_holdout_every(tmp_path: Path) -> None:
    path = write(tmp_path / "train.tsv", numbered(57))
    src = CriteoTSV(path, holdout_every=3)
    train = sample_ids(src.train_batches(0, 2, 5))  # global batches of 10: 0..4 complete, 5 partial
    evals = sample_ids(src.eval_batches(0, 2, 5))
    assert train == [*range(0, 5), *range(10, 15), *range(30, 35), *range(40, 45)]
    assert evals == [*range(20, 25)]  # global batches 2 (and 5, incomplete) are held out
    assert src.stats()["eval_dropped_tail_samples"] == 7
    assert src.stats()["train_dropped_tail_samples"] == 0


def test_a_count_after_a_whole_pass_reads_nothing_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A resume at the run's end passes over the whole training stream, then counts its batches (is the data as
    long as the checkpoint's position?): that count is the pass's, with no second parse of the files."""
    path = write(tmp_path / "train.tsv", numbered(57))
    src = CriteoTSV(path, holdout_every=3)
    assert src.count_train_batches(2, 5) == 4  # (global batches of 10: 0, 1, 3, 4 trained)
    assert len(list(src.train_batches_from(0, 2, 5, 3))) == 1  # a pass from batch 3 to the end
    monkeypatch.setattr(CriteoTSV, "_samples", lambda *a: pytest.fail("parsed again"))
    assert src.count_train_batches(2, 5, at_least=5) == 4
    assert src.count_train_batches(1, 10) == 4  # (the same global batches, split otherwise)
    monkeypatch.undo()
    assert src.count_train_batches(2, 3) == 6  # (another global batch size: counted; 9, every 3rd held out)


def test_config(tmp_path: Path) -> None:
    path = write(tmp_path / "train.tsv", numbered(4))
    cfg = OmegaConf.structured(DATA_CONFIGS["criteo_tsv"])
    cfg.paths = path
    src = build_data_source(cfg)
    assert isinstance(src, CriteoTSV) and src.num_embeddings == scaled_num_embeddings(0.01)
    assert (src.holdout_every, src.on_error, src.eval_paths) == (10, "raise", [])
    with pytest.raises(ValueError, match=r"unknown config key\(s\) \['pathz'\]"):
        build_data_source({"name": "criteo_tsv", "paths": path, "pathz": path})
    with pytest.raises(ValueError, match=r"missing config key\(s\) \['paths'\]"):
        build_data_source({"name": "criteo_tsv"})
    with pytest.raises(ValueError, match="mandatory value missing"):
        build_data_source(OmegaConf.structured(DATA_CONFIGS["criteo_tsv"]))
    with pytest.raises(ValueError, match="on_error"):
        CriteoTSV(path, on_error="ignore")
    with pytest.raises(ValueError, match="num_embeddings"):
        CriteoTSV(path, num_embeddings=[10] * 25)


def test_a_truncated_gzip_is_named_with_the_last_record_read(tmp_path: Path) -> None:
    whole = gzip.compress("".join(numbered(2000)).encode())
    path = tmp_path / "day_0.gz"
    path.write_bytes(whole[: len(whole) // 2])
    src = CriteoTSV(str(path), eval_paths=str(path), num_embeddings=NUM_EMB, on_error="skip")
    src.check()  # its first records are whole
    with pytest.raises(DataFormatError, match=r"day_0.gz:after record \d+: the file cannot be read on: EOFError: "):
        list(src.train_batches(0, 1, 10))


@pytest.mark.parametrize("where", ["first", "later"])
def test_bytes_that_are_not_utf8_are_named_with_the_file(tmp_path: Path, where: str) -> None:
    good = "".join(numbered(50)).encode()
    data = b"\xff" + good if where == "first" else good + b"\xff\n"
    path = tmp_path / "t.tsv"
    path.write_bytes(data)
    src = CriteoTSV(str(path), eval_paths=str(path), num_embeddings=NUM_EMB)
    read = src.check if where == "first" else lambda: list(src.train_batches(0, 1, 10))
    with pytest.raises(DataFormatError, match=r"t.tsv:after record \d+: the file cannot be read on: UnicodeDecodeError: "):
        read()


def test_a_tar_archive_and_a_directory_are_named_before_reading(tmp_path: Path) -> None:
    """Criteo Kaggle ships ``dac.tar.gz``: read as a gzip'd TSV its first record is glued to the tar header (a
    2,000-character line of NULs; with ``on_error=skip`` it trained on, one record short). ``check`` names it as an
    archive. A directory or an unexpanded pattern in ``paths`` is named as such (it was 'not found')."""
    import io
    import tarfile

    body = "".join(line() for _ in range(4)).encode()
    archive = tmp_path / "dac.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        info = tarfile.TarInfo("train.txt")
        info.size = len(body)
        tar.addfile(info, io.BytesIO(body))
    for on_error in ("raise", "skip"):
        with pytest.raises(DataFormatError) as err:
            CriteoTSV(str(archive), eval_paths=str(archive), on_error=on_error).check()
        assert str(err.value) == (f"{archive}:1: the file is a tar archive: extract its files (tar -xzf) and give those "
                                  f"(Criteo Kaggle's dac.tar.gz holds train.txt)")
    with pytest.raises(FileNotFoundError) as missing:
        CriteoTSV(str(tmp_path), eval_paths=str(tmp_path))
    assert str(missing.value) == f"data path(s) {tmp_path} are directories: give their files, as a list ([a.tsv,b.tsv])"
    with pytest.raises(FileNotFoundError) as pattern:
        CriteoTSV(f"{tmp_path}/*.tsv", eval_paths=f"{tmp_path}/*.tsv")
    assert str(pattern.value) == (f"data file(s) not found: {tmp_path}/*.tsv (a pattern is not expanded: give the files "
                                  f"as a list, [a.tsv,b.tsv])")
    corrupt = tmp_path / "corrupt.tsv.gz"  # (a gzip header, then a body that does not decompress)
    corrupt.write_bytes(gzip.compress(body)[:12] + b"\xff" * 64)
    with pytest.raises(DataFormatError, match=rf"^{corrupt}:after record 0: the file cannot be read on: error: Error -3"):
        CriteoTSV(str(corrupt), eval_paths=str(corrupt)).check()


@pytest.mark.parametrize("cell, field, problem", [
    ("-1a", 15, "expected a hexadecimal id, got '-1a'"), ("0x1a", 15, "expected a hexadecimal id, got '0x1a'"),
    (" 1a", 15, "expected a hexadecimal id, got ' 1a'"), ("1_a", 15, "expected a hexadecimal id, got '1_a'"),
    ("+5", 2, "expected an integer, got '+5'"), ("1_000", 2, "expected an integer, got '1_000'"),
    ("\u0663\u0663", 2, "expected an integer, got '\u0663\u0663'"), ("-", 2, "expected an integer, got '-'"),
    ("7 ", 2, "expected an integer, got '7 '"),
])
def test_a_cell_python_int_would_read_past_is_refused_naming_its_field(tmp_path: Path, cell: str, field: int,
                                                                         problem: str) -> None:
    """Python's int() takes a sign, 0x, _, spaces and non-ASCII digits: '-1a' was id 974 of a 1000-row table and
    '1_000' the count 1000, with no word. The format has ASCII digits (a minus on a count) and hexadecimal ids."""
    fields = line().rstrip("\n").split("\t")
    fields[field] = cell
    path = write(tmp_path / "train.tsv", [line(), "\t".join(fields) + "\n"])
    name = f"cat_{field - 14}" if field >= 14 else f"int_{field - 1}"
    with pytest.raises(DataFormatError) as err:
        list(CriteoTSV(path, eval_paths=path).train_batches(0, 1, 1))
    assert str(err.value) == f"{path}:2: field {field + 1} ({name}): {problem}"
    ok = line("1", ["-3"] + ["0"] * 12, ["00ff"] * 26)  # a negative count and an id's leading zeros still read
    assert len(list(CriteoTSV(write(tmp_path / "ok.tsv", [ok]), eval_paths=path).train_batches(0, 1, 1))) == 1


def test_blank_lines_hold_no_record_and_later_lines_keep_their_numbers(tmp_path: Path) -> None:
    """A blank line (a file's trailing one, say) failed the run after a whole epoch; it holds no record, as a CSV's."""
    lines = numbered(6)
    lines[3:3] = ["\n"]
    path = write(tmp_path / "train.tsv", lines + ["\n", "\r\n"])
    assert sample_ids(CriteoTSV(path, eval_paths=path).train_batches(0, 1, 2)) == list(range(6))
    bad = write(tmp_path / "bad.tsv", ["\n", line(), "\n", "zz\n"])
    with pytest.raises(DataFormatError, match=r"bad\.tsv:4: expected 40 tab-separated fields, got 1"):
        list(CriteoTSV(bad, eval_paths=path).train_batches(0, 1, 1))


def test_a_file_listed_twice_is_refused_naming_the_key(tmp_path: Path) -> None:
    """Listed twice, a file trained each epoch's rows twice, with no word."""
    path = write(tmp_path / "train.tsv", numbered(4))
    other = write(tmp_path / "eval.tsv", numbered(4))
    with pytest.raises(ValueError, match=r"^data\.paths lists .*train\.tsv more than once: each file is read once"):
        CriteoTSV([path, str(tmp_path / "." / "train.tsv")], eval_paths=other)
    with pytest.raises(ValueError, match=r"^data\.eval_paths lists .*eval\.tsv more than once"):
        CriteoTSV(path, eval_paths=[other, other])


def test_gzip_data_is_read_whatever_its_name_and_other_compression_is_named(tmp_path: Path) -> None:
    import bz2

    data = "".join(numbered(4)).encode()
    (tmp_path / "day_0.tsv").write_bytes(gzip.compress(data))
    src = CriteoTSV(tmp_path / "day_0.tsv", eval_paths=tmp_path / "day_0.tsv")
    src.check()
    assert sample_ids(src.train_batches(0, 1, 2)) == list(range(4))
    (tmp_path / "day_1.tsv").write_bytes(bz2.compress(data))
    with pytest.raises(DataFormatError, match=r"day_1\.tsv:1: the file is bzip2-compressed, which is not read here: "
                                              r"decompress it \(bunzip2\), or give it gzip'd"):
        CriteoTSV(tmp_path / "day_1.tsv", eval_paths=tmp_path / "day_0.tsv").check()


def test_an_evaluation_pads_the_last_global_batch_and_scores_every_sample_once(tmp_path: Path) -> None:
    """The eval split's incomplete last global batch was dropped (5 of 37 rows unscored); with ``pad_tail`` it is
    filled up with its own samples labelled PADDED_LABEL, which the metrics leave out."""
    from torchrec_herald.data.base import PADDED_LABEL

    path = write(tmp_path / "eval.tsv", numbered(37))
    src = CriteoTSV(write(tmp_path / "train.tsv", numbered(8)), eval_paths=path)
    per_rank = [list(src.eval_batches(r, 2, 4, pad_tail=True)) for r in range(2)]
    assert [len(b) for b in per_rank] == [5, 5] and src.stats()["eval_dropped_tail_samples"] == 0
    scored = [i for r in range(2) for b in per_rank[r] for i, y in zip(sample_ids([b]), b.labels.tolist())
              if y != PADDED_LABEL]
    assert sorted(scored) == list(range(37))
    last = [per_rank[r][-1].labels.tolist() for r in range(2)]
    assert last == [[0.0, 1.0, 0.0, 1.0], [0.0, PADDED_LABEL, PADDED_LABEL, PADDED_LABEL]]
    assert len(list(src.eval_batches(0, 2, 4))) == 4 and src.stats()["eval_dropped_tail_samples"] == 5  # (default)


def test_a_held_out_split_holds_a_sample_once_the_data_reaches_its_first_held_out_batch(tmp_path: Path) -> None:
    path = write(tmp_path / "train.tsv", numbered(21))
    assert CriteoTSV(path, holdout_every=3).holds_eval_samples(2, 5)  # batch 2 holds sample 20
    assert not CriteoTSV(path, holdout_every=4).holds_eval_samples(2, 5)  # batch 3 would start at 30
    assert CriteoTSV(path, eval_paths=write(tmp_path / "e.tsv", numbered(1))).holds_eval_samples(2, 5)


@pytest.mark.parametrize("rows, holdout_every, at_least, holds", [
    (60, 3, 3, True),    # the count passed batch 2 (held out) to find 3 trained batches
    (21, 4, 4, False),   # the count reached the stream's end (2 trained batches): batch 3 would start at 30
    (21, 3, 4, True),    # the stream's end, past sample 20 of batch 2
])
def test_a_count_that_passed_the_first_held_out_batch_answers_whether_eval_holds_a_sample_without_parsing_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, rows: int, holdout_every: int, at_least: int,
        holds: bool) -> None:
    src = CriteoTSV(write(tmp_path / "train.tsv", numbered(rows)), holdout_every=holdout_every)
    src.count_train_batches(2, 5, at_least=at_least)
    monkeypatch.setattr(src, "_samples", lambda paths: pytest.fail("parsed the training files again"))
    assert src.holds_eval_samples(2, 5) is holds


def test_a_rewound_stream_returns_its_kept_batches_without_reading_the_source_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A herald pipeline's window starts again at the data's position at every checkpoint: the stream went back to
    the source, which parsed the file from the pass's start each time (a checkpoint near the end of a Criteo day
    re-parsed the whole day on every rank)."""
    path = write(tmp_path / "train.tsv", numbered(40))
    src = CriteoTSV(path, eval_paths=path)
    reads: List[int] = []
    opened = CriteoTSV.train_batches_from
    monkeypatch.setattr(CriteoTSV, "train_batches_from", lambda self, *a: reads.append(a[-1]) or opened(self, *a))
    stream = TrainStream(src, 1, 2, 2, keep=3)
    first = [sample_ids([next(stream)]) for _ in range(5)]
    assert first == [[2 * g * 2 + 2, 2 * g * 2 + 3] for g in range(5)] and reads == [0]
    assert [sample_ids([b]) for b in stream.rewind(2)] == first[2:] + [[22, 23], [26, 27], [30, 31], [34, 35], [38, 39]]
    assert reads == [0]  # batches 2-4 came from memory, the rest from the same reader
    stream.rewind(6)
    assert sample_ids([next(stream)]) == [26, 27] and reads == [0, 6]  # 4 back, 3 kept: read from the source
    stream.rewind(7)
    stream.whole = True  # kept as slices, wanted whole: read again, in the wanted form
    assert sample_ids([next(stream)]) == [28, 29, 30, 31] and reads == [0, 6, 7]


def _same_data_check(rank: int, world: int, folders: List[str]) -> str:
    """Rank ``rank`` reads ``day_0.tsv`` of its own folder (as a host's own copy) and checks it against the others'."""
    from torchrec_herald.data.base import check_same_data_on_every_rank
    from torchrec_herald.data.criteo_tsv import CriteoTSV

    try:
        check_same_data_on_every_rank(CriteoTSV(os.path.join(folders[rank], "day_0.tsv")).fingerprint())
    except ValueError as e:
        return str(e)
    return "same"


def test_a_data_file_whose_copy_differs_on_another_host_is_named_before_training(tmp_path: Path) -> None:
    """Every rank makes each global batch from the same files. A host whose copy was cut short or is another
    version trained other samples, or ended early and left the others waiting in a collective. Each rank reads
    its own copy here (as each host would); the check names the file, its sizes and the ranks that differ."""
    import socket

    from torchrec_herald.dist_utils import run_multiprocess

    rows = numbered(40)
    folders = [str(tmp_path / "host0"), str(tmp_path / "host1")]
    for f in folders:
        os.makedirs(f)
    whole = "".join(rows)
    (tmp_path / "host0" / "day_0.tsv").write_text(whole)
    (tmp_path / "host1" / "day_0.tsv").write_text(whole)
    assert run_multiprocess(_same_data_check, 2, folders, timeout_s=120) == ["same", "same"]
    host = socket.gethostname()
    tail = (". Every rank makes each global batch from the same files: copy them whole to every host, or read them "
            "from a file system every host shares")
    (tmp_path / "host1" / "day_0.tsv").write_text("".join(rows[:30]))  # (a copy cut short)
    cut = len("".join(rows[:30]).encode())
    got = run_multiprocess(_same_data_check, 2, folders, timeout_s=120)
    assert got == [f"data.paths file {folders[0]}/day_0.tsv differs between ranks: {len(whole.encode())} bytes on rank 0 "
                   f"(host {host}), {cut} on rank(s) 1 (host {host}){tail}"] * 2, got
    other = whole.replace(rows[39], line("0", ["39"] + ["1"] * 12))  # (the same size, other bytes)
    (tmp_path / "host1" / "day_0.tsv").write_text(other)
    got = run_multiprocess(_same_data_check, 2, folders, timeout_s=120)
    assert got == [f"data.paths file {folders[0]}/day_0.tsv differs between ranks: the same {len(whole.encode())} bytes "
                   f"on rank 0 (host {host}) and rank(s) 1 (host {host}), but other bytes at its start or end{tail}"] * 2, got
