import os
import tempfile

os.environ["HF_HUB_OFFLINE"] = "1"  # tests must never reach a hub
# A fresh store per session: a prompt-cache hit left by an earlier run would change what runs.
os.environ["MEMFIT_CACHE_DIR"] = tempfile.mkdtemp(prefix="memfit-test-cache-")

import pytest  # noqa: E402


from memfit.cli.app import _quiet_libraries  # noqa: E402

_quiet_libraries()


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


def pytest_sessionfinish(session, exitstatus):
    import shutil

    shutil.rmtree(os.environ["MEMFIT_CACHE_DIR"], ignore_errors=True)
