"""diffusers and transformers kept quiet while memfit runs, for the CLI and the Python API alike.

They print loading bars and config warnings for every stage memfit loads (a staged run loads
the pipeline three times); memfit shows its own progress and reports, and turns what matters
into its own errors and warnings (missing weights, a prompt cut short). One behaviour for
``memfit generate`` and ``memfit.generate``.
"""

from __future__ import annotations

__all__ = ["quiet_libraries"]


def quiet_libraries() -> None:
    import diffusers
    import transformers

    diffusers.utils.logging.disable_progress_bar()
    diffusers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
