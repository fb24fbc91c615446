"""memfit's on-disk, content-addressed cache (compiled artifacts, prompt embeddings, ...).

    from memfit.cache import CacheKey, open_store
    key = CacheKey("compiled", {"weights": fingerprint, "backend": "onnxruntime", ...})
    path = open_store().get_or_build(key, lambda out_dir: export_into(out_dir))
"""

from memfit.cache.key import CACHE_FORMAT_VERSION, CacheKey, compile_key, library_versions
from memfit.cache.settings import DEFAULT_MAX_BYTES, CacheMode
from memfit.cache.store import BadEntry, CacheCorruptionWarning, CacheEntry, CacheStore, CacheUnavailableWarning


def open_store() -> CacheStore:
    """The store configured by the environment (MEMFIT_CACHE_DIR, MEMFIT_CACHE, ..._MAX_BYTES).

    Reads the environment on every call, so a changed variable takes effect for the next store.
    """
    return CacheStore()


__all__ = [
    "CACHE_FORMAT_VERSION",
    "DEFAULT_MAX_BYTES",
    "BadEntry",
    "CacheCorruptionWarning",
    "CacheEntry",
    "CacheKey",
    "CacheMode",
    "CacheStore",
    "CacheUnavailableWarning",
    "compile_key",
    "library_versions",
    "open_store",
]
