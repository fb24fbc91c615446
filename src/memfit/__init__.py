"""memfit: run diffusers pipelines inside a memory budget, fast, on whatever hardware you have.

The public names load on first use (PEP 562): ``import memfit`` and the ``memfit`` command's help and
argument errors do not pay for importing torch (seconds), only what uses it does.
"""

from importlib import import_module as _import_module

from memfit.version import __version__

# Public name -> the module that defines it.
_PUBLIC = {
    "Budget": "memfit.plan.budget",
    "Embeddings": "memfit.run.embeddings",
    "Generation": "memfit.run.generate",
    "MemfitError": "memfit.errors",
    "RunReport": "memfit.run.report",
    "StageReport": "memfit.run.report",
    "encode": "memfit.run.generate",
    "generate": "memfit.run.generate",
    "optimize": "memfit.run.executor",
    "parse_size": "memfit.sizes",
    "process_peak_rss": "memfit.run.memory",
    "restore": "memfit.run.executor",
}

__all__ = sorted([*_PUBLIC, "__version__"])


def __getattr__(name: str):
    """A public name, imported from its module on first use; any other name is missing as usual."""
    if name not in _PUBLIC:
        raise AttributeError(f"module 'memfit' has no attribute {name!r}")
    value = getattr(_import_module(_PUBLIC[name]), name)
    globals()[name] = value  # bound now: later look-ups do not come here
    return value


def __dir__() -> list[str]:
    # The public names are listed before they are loaded, so completion and help() see them all.
    return sorted({*globals(), *_PUBLIC})
