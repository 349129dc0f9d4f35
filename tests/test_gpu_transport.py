"""scripts/gpu/slim_wheel.py, which brings fbgemm-gpu to the lent GPU machine: it zeroes exactly the cubins
of other architectures, keeps every header and every other byte, and writes a wheel whose RECORD matches."""

from __future__ import annotations

import base64
import hashlib
import importlib.util
import struct
import zipfile
from pathlib import Path

import pytest

_SPEC = importlib.util.spec_from_file_location("slim_wheel", Path(__file__).resolve().parents[1] / "scripts/gpu/slim_wheel.py")
slim = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(slim)  # type: ignore[union-attr]


def _entry(kind: int, arch: int, payload: bytes) -> bytes:
    """A fat-binary entry: 64-byte header (kind, header size, payload size, ..., arch at byte 28) + payload."""
    head = bytearray(64)
    struct.pack_into("<HHIQ", head, 0, kind, 0x101, 64, len(payload))
    struct.pack_into("<I", head, 28, arch)
    return bytes(head) + payload


def _fatbin(entries: list[bytes]) -> bytes:
    body = b"".join(entries)
    return slim.FATBIN_MAGIC + struct.pack("<HHQ", 1, 16, len(body)) + body


def _library() -> tuple[bytes, dict[int, bytes]]:
    payloads = {80: b"\x11" * 40, 90: b"\x22" * 24, 100: b"\x33" * 32}
    ptx = _entry(1, 80, b"ptx text for sm_80")
    blob = b"ELF-prefix" + _fatbin([_entry(2, a, p) for a, p in payloads.items()] + [ptx]) + b"suffix" + \
        _fatbin([_entry(2, 100, b"\x44" * 8)])
    return blob, payloads


def test_only_foreign_cubins_are_zeroed_headers_and_ptx_kept() -> None:
    blob, payloads = _library()
    buf = bytearray(blob)
    zeroed, cubins = slim.zero_foreign_cubins(buf, {90})
    assert (zeroed, cubins) == (40 + 32 + 8, 3)
    assert len(buf) == len(blob)
    changed = [i for i, (x, y) in enumerate(zip(blob, buf)) if x != y]
    # exactly the sm_80 and sm_100 payload bytes changed, to zeros
    assert len(changed) == 80 and all(buf[i] == 0 for i in changed)
    assert payloads[90] in buf and b"ptx text for sm_80" in buf and b"\x11" not in buf and b"\x33" not in buf
    assert buf.startswith(b"ELF-prefix") and b"suffix" in buf


def test_nothing_is_zeroed_when_every_architecture_is_kept() -> None:
    blob, _ = _library()
    buf = bytearray(blob)
    assert slim.zero_foreign_cubins(buf, {80, 90, 100}) == (0, 0)
    assert bytes(buf) == blob


def test_slimmed_wheel_has_a_matching_record(tmp_path: Path) -> None:
    blob, payloads = _library()
    wheel = tmp_path / "in" / "pkg-1.0-cp312-cp312-manylinux_2_28_x86_64.whl"
    wheel.parent.mkdir()
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("pkg/lib.so", blob)
        z.writestr("pkg/__init__.py", "x = 1\n")
        z.writestr("pkg-1.0.dist-info/RECORD", "stale,,\n")
    out = slim.slim_wheel(wheel, tmp_path / "out", {90})
    with zipfile.ZipFile(out) as z:
        lib = z.read("pkg/lib.so")
        records = dict((r.split(",")[0], r.split(",")[1:]) for r in z.read("pkg-1.0.dist-info/RECORD").decode().split())
        for name in ("pkg/lib.so", "pkg/__init__.py"):
            data = z.read(name)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            assert records[name] == [f"sha256={digest}", str(len(data))]
    assert payloads[90] in lib and payloads[80] not in lib and len(lib) == len(blob)


def test_a_file_that_is_not_a_wheel_is_named(tmp_path: Path) -> None:
    wheel = tmp_path / "bad.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("pkg/lib.so", b"x")
    with pytest.raises(ValueError, match=r"bad\.whl: no \.dist-info/RECORD, not a wheel"):
        slim.slim_wheel(wheel, tmp_path / "out", {90})
    assert list((tmp_path / "out").iterdir()) == []  # nothing half-written left behind
