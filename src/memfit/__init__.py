"""memfit: run diffusers pipelines inside a memory budget, fast, on whatever hardware you have."""

from memfit.version import __version__
from memfit.plan.budget import Budget
from memfit.sizes import parse_size
from memfit.run.embeddings import Embeddings
from memfit.errors import MemfitError
from memfit.run.executor import optimize, restore
from memfit.run.report import RunReport, StageReport
from memfit.run.generate import Generation, encode, generate
from memfit.run.memory import process_peak_rss

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
    "process_peak_rss",
    "restore",
]
