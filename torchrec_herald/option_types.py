"""Type checks of a config dataclass's fields where the Python API builds it (Hydra's typed config checks the
command line's): one ``ValueError`` naming the key, where ``int()`` would cut 2.5 to 2, ``bool("no")`` be true,
or an infinite float search for ever."""

from __future__ import annotations

import math
import numbers
from typing import Any


def check_int(key: str, value: Any, optional: bool = False) -> None:
    """``value`` is an integer (an integral float too: YAML may write ``5.0``), or None where ``optional``."""
    if value is None and optional:
        return
    if isinstance(value, bool) or not (isinstance(value, numbers.Integral) or (isinstance(value, float) and value.is_integer())):
        raise ValueError(f"{key} must be an integer{' or null' if optional else ''}, got {value!r}")


def check_bool(key: str, value: Any, optional: bool = False) -> None:
    """``value`` is True or False, or None where ``optional`` (a string such as ``"false"`` is refused: it is true)."""
    if value is None and optional:
        return
    if not isinstance(value, bool):
        raise ValueError(f"{key} must be true or false{' or null' if optional else ''}, got {value!r}")


def check_real(key: str, value: Any) -> None:
    """``value`` is a finite number."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{key} must be a finite number, got {value!r}")
