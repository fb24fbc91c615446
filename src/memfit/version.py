"""memfit's version: a leaf module, so any layer can name it without importing the package root (which imports every
layer), and the build reads it from here without importing anything (pyproject.toml's dynamic version)."""

__version__ = "0.1.0"

__all__ = ["__version__"]
