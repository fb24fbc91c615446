"""`memfit cache ls | verify | clear`: look at, check and empty the on-disk cache.

`register(subparsers)` adds the `cache` command to memfit's CLI; each subcommand sets
``func(args) -> exit code``. MemfitErrors propagate to the CLI, which prints them.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from memfit.cache import CacheStore
from memfit.errors import MemfitError


def register(subparsers: "argparse._SubParsersAction") -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "cache",
        help="list, verify or clear memfit's on-disk cache",
        description="Inspect memfit's content-addressed cache (MEMFIT_CACHE_DIR, default the user cache dir).",
    )
    parser.add_argument("--cache-dir", help="cache root (default: MEMFIT_CACHE_DIR or the user cache dir)")
    actions = parser.add_subparsers(dest="cache_command", metavar="{ls,verify,clear}")
    actions.required = True

    ls = actions.add_parser("ls", help="list entries, most recently used first")
    ls.add_argument("--kind", help="only entries of this kind (e.g. compiled)")
    ls.add_argument("--json", action="store_true", help="print a JSON list instead of a table")
    ls.set_defaults(func=cmd_ls)

    verify = actions.add_parser("verify", help="rehash every file of every entry (a load trusts a file unchanged "
                                "since it was hashed); exit 1 if any is bad")
    verify.add_argument("--kind", help="only entries of this kind")
    verify.add_argument("--remove", action="store_true", help="also remove the bad entries")
    verify.set_defaults(func=cmd_verify)

    clear = actions.add_parser("clear", help="remove entries (all, or of one --kind) without asking")
    clear.add_argument("--kind", help="only entries of this kind")
    clear.set_defaults(func=cmd_clear)
    return parser


def _store(args: argparse.Namespace) -> CacheStore:
    # Maintenance works on the files on disk whatever MEMFIT_CACHE says (clearing a cache that
    # is switched off must still clear it).
    store = CacheStore(getattr(args, "cache_dir", None), mode="on")
    if store.root.exists() and not store.root.is_dir():
        raise MemfitError(
            f"The memfit cache path {store.root} is a file, not a folder; point MEMFIT_CACHE_DIR (or --cache-dir) "
            "at the cache folder, or move the file away."
        )
    return store


def cmd_ls(args: argparse.Namespace) -> int:
    store = _store(args)
    entries = store.ls(kind=args.kind)
    if args.json:
        json.dump([entry.to_dict() for entry in entries], sys.stdout, indent=1)
        sys.stdout.write("\n")
        return 0
    if not entries:
        print(f"memfit cache at {store.root} is empty.")
        return 0
    print(f"{'KIND':<12} {'KEY':<12} {'SIZE':>10} {'LAST USED':<19} SUMMARY")
    for entry in entries:
        print(
            f"{entry.kind:<12} {entry.digest[:12]:<12} {_human_size(entry.size):>10} "
            f"{_when(entry.last_used):<19} {entry.summary}"
        )
    total = sum(entry.size for entry in entries)
    print(f"{len(entries)} entries, {_human_size(total)} of {_human_size(store.max_bytes)} at {store.root}")
    if any("..." in entry.summary for entry in entries):
        print("(long parts of a summary, such as prompts, end in '...'; `memfit cache ls --json` gives them whole)")
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    store = _store(args)
    checked = len(store.ls(kind=args.kind))
    bad = store.verify(kind=args.kind, remove_bad=args.remove)
    for entry in bad:
        print(f"BAD {entry}", file=sys.stderr)
    if bad:
        what_next = "removed; they will be rebuilt on next use" if args.remove else (
            "run `memfit cache verify --remove` (or `memfit cache clear`) to remove them"
        )
        print(f"{len(bad)} of {checked} entries are damaged: {what_next}.", file=sys.stderr)
        return 1
    print(f"{checked} entries verified, all intact ({store.root}).")
    return 0


def cmd_clear(args: argparse.Namespace) -> int:
    store = _store(args)
    removed = store.clear(kind=args.kind)
    scope = f" of kind {args.kind!r}" if args.kind else ""
    print(f"Removed {removed} entries{scope} from {store.root}.")
    return 0


def _human_size(size: int) -> str:
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def _when(timestamp: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(timestamp)) if timestamp else "-"
