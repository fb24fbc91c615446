import os

os.environ["HF_HUB_OFFLINE"] = "1"  # tests must never reach a hub
os.environ.setdefault("MEMFIT_CACHE_DIR", os.path.join(os.environ.get("TMPDIR", "/tmp"), "memfit-test-cache"))

import pytest  # noqa: E402


def _quiet():
    import diffusers
    import transformers

    diffusers.utils.logging.disable_progress_bar()
    diffusers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()


_quiet()


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """kind -> folder of a tiny pipeline saved in the diffusers layout (built once per session)."""
    from memfit.testing import save_pipeline

    root = tmp_path_factory.mktemp("tiny-models")
    cache: dict[str, str] = {}

    def get(kind: str):
        if kind not in cache:
            cache[kind] = str(save_pipeline(kind, root / kind, seed=0))
        return cache[kind]

    return get
