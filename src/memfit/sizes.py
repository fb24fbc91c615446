"""Byte counts for people: parse "6GiB" / "6GB" into bytes, and format bytes back.

A size is always in **bytes**. "6GB" is 6 * 10**9 bytes and "6GiB" is 6 * 2**30 bytes; the
letter case of the unit is ignored, so "6Gb" and "6gb" also mean gigabytes, never gigabits:
nobody sizes model weights in bits, and a silent factor of 8 would be far worse than an
unconventional reading of "b".
"""

from __future__ import annotations

import re
from typing import Union

from memfit.errors import MemfitError

__all__ = ["format_bytes", "parse_size", "round_up_mib"]

_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "kib": 2**10,
    "m": 10**6,
    "mb": 10**6,
    "mib": 2**20,
    "g": 10**9,
    "gb": 10**9,
    "gib": 2**30,
    "t": 10**12,
    "tb": 10**12,
    "tib": 2**40,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)\s*$", re.IGNORECASE)
_EXAMPLES = '"6GiB", "6GB" (= 6*10^9), "512MiB", "1.5 GiB", or an int number of bytes such as 1073741824'

def parse_size(value: Union[int, str]) -> int:
    """Return ``value`` as a number of bytes.

    Accepts an int (bytes) or a string: a number, optionally with a decimal part, and an optional
    unit among B, K/KB/KiB, M/MB/MiB, G/GB/GiB, T/TB/TiB (case-insensitive; "B" and "b" both mean
    bytes, never bits). A plain number string ("100") is bytes. Fractions are rounded down to a
    whole byte.
    """
    if isinstance(value, bool):  # bool is an int subclass; True bytes is surely a mistake
        raise MemfitError(f"Size {value!r} is a bool, not a size. Use e.g. {_EXAMPLES}.")
    if isinstance(value, int):
        if value < 0:
            raise MemfitError(f"Size {value!r} is negative. Use a byte count >= 0, e.g. {_EXAMPLES}.")
        return value
    if not isinstance(value, str):
        raise MemfitError(
            f"Size {value!r} has type {type(value).__name__}; expected an int or a string like {_EXAMPLES}."
        )
    match = _SIZE_RE.match(value)
    if match is None or match.group(2).lower() not in _UNITS:
        raise MemfitError(f"Cannot read {value!r} as a size. Use e.g. {_EXAMPLES}.")
    number, unit = match.groups()
    return int(float(number) * _UNITS[unit.lower()])


def format_bytes(n: int | float) -> str:
    """Render a byte count in binary units: 1536 -> "1.50 KiB", 4*2**30 -> "4.00 GiB", 12 -> "12 B"."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"


def round_up_mib(size: int) -> int:
    """``size`` bytes in whole MiB, rounded up: what a message tells a user to pass as --budget."""
    return -(-int(size) // (1 << 20))
