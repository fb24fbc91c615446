"""The `memfit` command line: one module per subcommand, `app` ties them together."""

from memfit.cli.app import main

__all__ = ["main"]
