"""Where the cache lives, whether it is on, and how big it may grow (read from the environment).

    MEMFIT_CACHE_DIR        root directory (default: the platform's user cache dir + /memfit)
    MEMFIT_CACHE            "1"/"on" (default), "0"/"off" (every lookup misses, writes are
                            skipped), "require" (a miss raises instead of building: lets CI prove
                            that a start was fully served from the cache)
    MEMFIT_CACHE_MAX_BYTES  size limit, bytes or "20GiB"/"500MB"; least recently used entries
                            are evicted past it (default 20 GiB)
"""

from __future__ import annotations

import enum
import os
import sys
from pathlib import Path

from memfit.errors import MemfitError

DEFAULT_MAX_BYTES = 20 * 1024**3


class CacheMode(enum.Enum):
    ON = "on"
    OFF = "off"
    REQUIRE = "require"


_MODE_WORDS = {
    "": CacheMode.ON,
    "1": CacheMode.ON,
    "on": CacheMode.ON,
    "true": CacheMode.ON,
    "yes": CacheMode.ON,
    "0": CacheMode.OFF,
    "off": CacheMode.OFF,
    "false": CacheMode.OFF,
    "no": CacheMode.OFF,
    "require": CacheMode.REQUIRE,
}


def mode_from_env() -> CacheMode:
    raw = os.environ.get("MEMFIT_CACHE", "")
    try:
        return _MODE_WORDS[raw.strip().lower()]
    except KeyError:
        raise MemfitError(
            f"MEMFIT_CACHE={raw!r} is not understood. Use 1 (cache on), 0 (cache off) or "
            "'require' (fail on any cache miss)."
        ) from None


def default_root() -> Path:
    """MEMFIT_CACHE_DIR, else the platform's per-user cache directory followed by /memfit."""
    override = os.environ.get("MEMFIT_CACHE_DIR")
    if override:
        return Path(override).expanduser()
    if sys.platform == "win32":
        base = os.environ.get("LOCALAPPDATA") or str(Path.home() / "AppData" / "Local")
        return Path(base) / "memfit" / "Cache"
    if sys.platform == "darwin":
        return Path.home() / "Library" / "Caches" / "memfit"
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "memfit"


def parse_size(text: str, *, source: str) -> int:
    """A size from the environment variable `source`, with the budget layer's rules."""
    from memfit.sizes import parse_size as parse_budget_size

    try:
        return parse_budget_size(text)
    except MemfitError as error:
        raise MemfitError(f"{source}={text!r} is not a size: {error}") from None


def max_bytes_from_env() -> int:
    raw = os.environ.get("MEMFIT_CACHE_MAX_BYTES")
    if raw is None or not raw.strip():
        return DEFAULT_MAX_BYTES
    return parse_size(raw, source="MEMFIT_CACHE_MAX_BYTES")
