"""The `memfit` command: one module per subcommand (generate and encode, plan, cache, batch) registers its parser.

Errors for bad input are MemfitErrors: printed as one sentence, exit status 2, no traceback
unless --debug. Output files are written atomically, so a failed run leaves none behind.
"""

from __future__ import annotations

import argparse
import os
import sys

from memfit.cli import batch, cache, generate, plan
from memfit.errors import MemfitError


def build_parser() -> argparse.ArgumentParser:
    from memfit import __version__

    parser = argparse.ArgumentParser(prog="memfit", description="Run diffusers pipelines inside a memory budget.")
    parser.add_argument("--version", action="version", version=f"memfit {__version__}")
    parser.add_argument("--debug", action="store_true", help="show full tracebacks")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    commands.required = True

    for module in (generate, plan, cache, batch):
        module.register(commands)
    return parser


def quiet_libraries() -> None:
    # diffusers/transformers print loading bars and config warnings for every stage; memfit
    # shows its own progress instead.
    import diffusers
    import transformers

    diffusers.utils.logging.disable_progress_bar()
    diffusers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # memfit never downloads; fail fast instead
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        quiet_libraries()
        return args.func(args)
    except MemfitError as exc:
        if args.debug:
            raise
        print(f"memfit: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("memfit: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
