"""The `memfit` command: one module per subcommand (generate and encode, plan, cache, serve, batch) registers its parser.

Building the parser imports no torch, diffusers or transformers (seconds of start-up): help and argument
errors come at once, and each command imports them (and quiets them, memfit.run.libraries) only when it
has refused what it can without a model.

Errors for bad input are MemfitErrors: printed as one sentence, exit status 2, no traceback unless --debug.
A device running out of memory anywhere a run's stages do not handle it (torch's OutOfMemoryError) is
printed the same way. Output files are written atomically, so a failed run leaves none behind.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings

from memfit.cli import batch, cache, generate, plan, serve
from memfit.errors import MemfitError
from memfit.version import __version__


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="memfit", description="Run diffusers pipelines inside a memory budget.")
    parser.add_argument("--version", action="version", version=f"memfit {__version__}")
    parser.add_argument("--debug", action="store_true", help="show full tracebacks")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    commands.required = True

    for module in (generate, plan, cache, serve, batch):
        module.register(commands)
    for command in _subcommands(parser).values():
        # Also after the subcommand (`memfit generate --debug`); SUPPRESS keeps the top-level value otherwise.
        command.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show full tracebacks")
    return parser


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """Every subcommand's parser by name, nested ones (cache ls) included."""
    found = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, command in action.choices.items():
                found[name] = command
                found.update({f"{name} {sub}": nested for sub, nested in _subcommands(command).items()})
    return found


def _parse(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """``parser.parse_args``, except that a flag no parser knows is refused by the subcommand that got it, with
    its usage and the closest flag it has (argparse would print the top-level usage and no suggestion)."""
    import difflib

    args, unknown = parser.parse_known_args(argv)
    if not unknown:
        return args
    commands = _subcommands(parser)
    chosen = [name for name in commands if all(part in (argv if argv is not None else sys.argv[1:])
                                               for part in name.split())]
    command = commands[max(chosen, key=len)] if chosen else parser
    known = [option for action in command._actions for option in action.option_strings]
    hints = []
    for flag in unknown:
        close = difflib.get_close_matches(flag.split("=")[0], known, n=1) if flag.startswith("-") else []
        hints.append(f"{flag} (did you mean {close[0]}?)" if close else flag)
    command.error(f"unrecognized arguments: {' '.join(hints)}")


def _show_warning(message, category, filename, lineno, file=None, line=None, *, _default=warnings.showwarning):
    # memfit's own warnings are sentences for the user (a cache that cannot be used, a prompt cut
    # short): one line each, like errors, not a source location.
    if category.__module__.startswith("memfit"):
        print(f"memfit: warning: {message}", file=file or sys.stderr)
    else:
        _default(message, category, filename, lineno, file, line)


def _out_of_memory(exc: BaseException) -> bool:
    torch = sys.modules.get("torch")  # not imported: then nothing raised torch's error
    return torch is not None and isinstance(exc, torch.OutOfMemoryError)


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # memfit never downloads; fail fast instead
    parser = build_parser()
    args = _parse(parser, argv)
    previous = warnings.showwarning
    warnings.showwarning = _show_warning
    try:
        return args.func(args)
    except MemfitError as exc:
        if args.debug:
            raise
        print(f"memfit: error: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:
        if args.debug or not _out_of_memory(exc):
            raise
        from memfit.run.runner import out_of_memory_message

        print(f"memfit: error: {out_of_memory_message(exc, 'outside the stages memfit plans')}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("memfit: interrupted", file=sys.stderr)
        return 130
    finally:
        warnings.showwarning = previous


if __name__ == "__main__":
    sys.exit(main())
