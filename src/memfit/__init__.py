"""memfit: run diffusers pipelines inside a memory budget, fast, on whatever hardware you have."""

__version__ = "0.1.0"

from .budget import Budget, parse_size
from .embeddings import Embeddings
from .errors import MemfitError
from .executor import optimize, restore
from .report import RunReport, StageReport
from .staged import Generation, encode, generate

__all__ = [
    "Budget",
    "Embeddings",
    "Generation",
    "MemfitError",
    "RunReport",
    "StageReport",
    "__version__",
    "encode",
    "generate",
    "optimize",
    "parse_size",
    "restore",
]
