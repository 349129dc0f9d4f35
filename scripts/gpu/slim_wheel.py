"""Shrink a CUDA wheel for transport to one known GPU by zeroing the cubins of other architectures.

The lent GPU machine (H100/H200, sm_90) has no package registry and takes at most 64 MiB per call, while
fbgemm-gpu's wheel is 465 MB: its shared libraries are fat binaries holding one cubin per architecture
(sm_80, sm_90, sm_100). This tool overwrites with zeros the payload of every cubin whose architecture is
not kept, leaving every fat-binary header and the ELF layout intact (the driver picks the sm_90 entry and
never reads the others), so the rewritten wheel compresses to a fraction of its size. Written by hand
because no NVIDIA tool prunes architectures out of a linked shared library (nvprune takes object files).

    python scripts/gpu/slim_wheel.py fbgemm_gpu-1.6.0-cp312-cp312-manylinux_2_28_x86_64.whl out_dir --keep 90
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import logging
import struct
import zipfile
from pathlib import Path

log = logging.getLogger("slim_wheel")

FATBIN_MAGIC = b"\x50\xed\x55\xba"  # 0xBA55ED50, little endian
ELF_CUBIN = 2  # entry kind 2 is a cubin (ELF); kind 1 is PTX, always kept


def zero_foreign_cubins(data: bytearray, keep: set[int]) -> tuple[int, int]:
    """Zero, in place, the payload of each cubin whose sm architecture is not in ``keep``.

    Returns (bytes zeroed, cubins zeroed)."""
    zeroed = cubins = 0
    pos = data.find(FATBIN_MAGIC)
    while pos >= 0:
        version, header_size, fat_size = struct.unpack_from("<HHQ", data, pos + 4)
        end = pos + header_size + fat_size
        if version != 1 or header_size != 16 or end > len(data):
            pos = data.find(FATBIN_MAGIC, pos + 4)
            continue
        entry = pos + header_size
        while entry + 32 <= end:
            kind, _, entry_header, payload = struct.unpack_from("<HHIQ", data, entry)
            arch = struct.unpack_from("<I", data, entry + 28)[0]
            start = entry + entry_header
            if entry_header < 32 or start + payload > end:
                break
            if kind == ELF_CUBIN and arch not in keep:
                data[start : start + payload] = bytes(payload)
                zeroed += payload
                cubins += 1
            entry = start + payload
        pos = data.find(FATBIN_MAGIC, end)
    return zeroed, cubins


def _record_hash(blob: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(blob).digest()).rstrip(b"=").decode()
    return f"sha256={digest}"


def slim_wheel(wheel: Path, out_dir: Path, keep: set[int]) -> Path:
    """Write ``out_dir/<wheel name>`` with foreign cubins zeroed and a RECORD that matches."""
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / wheel.name
    part = out_dir / (wheel.name + ".part")  # renamed once complete: no half-written wheel is left behind
    try:
        _write_slim(wheel, part, keep)
    except BaseException:
        part.unlink(missing_ok=True)
        raise
    part.replace(out)
    return out


def _write_slim(wheel: Path, out: Path, keep: set[int]) -> None:
    records: list[str] = []
    record_name = None
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as dst:
        for info in src.infolist():
            if info.filename.endswith(".dist-info/RECORD"):
                record_name = info.filename
                continue
            blob = src.read(info)
            if info.filename.endswith(".so"):
                buf = bytearray(blob)
                zeroed, cubins = zero_foreign_cubins(buf, keep)
                blob = bytes(buf)
                if cubins:
                    log.info("%s: %d cubins, %.0f MB zeroed", info.filename, cubins, zeroed / 1e6)
            dst.writestr(info, blob, compress_type=zipfile.ZIP_DEFLATED, compresslevel=9)
            records.append(f"{info.filename},{_record_hash(blob)},{len(blob)}")
        if record_name is None:
            raise ValueError(f"{wheel}: no .dist-info/RECORD, not a wheel")
        records.append(f"{record_name},,")
        dst.writestr(record_name, "\n".join(records) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("wheel", type=Path)
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--keep", type=int, nargs="+", default=[90], help="sm architectures to keep (90: H100/H200)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    out = slim_wheel(args.wheel, args.out_dir, set(args.keep))
    log.info("%s: %.0f MB -> %.0f MB", out.name, args.wheel.stat().st_size / 1e6, out.stat().st_size / 1e6)


if __name__ == "__main__":
    main()
