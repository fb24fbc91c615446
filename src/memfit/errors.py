"""The one exception type users see.

Every error raised for bad input or an unusable environment is a MemfitError whose message is a
complete sentence: what happened, naming the file, key or component, and what to do next. The CLI
prints the message alone (no traceback unless --debug) and exits non-zero.
"""


class MemfitError(Exception):
    """A problem the user can fix; the message says how."""


class MemfitWarning(UserWarning):
    """Something the user should know that does not stop the run (a prompt cut short); the CLI
    prints it as one line."""
