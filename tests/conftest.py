import os
import tempfile

os.environ["HF_HUB_OFFLINE"] = "1"  # tests must never reach a hub
# Never the user's own store; each test also gets a store of its own (the autouse fixture below),
# so a prompt-cache hit left by another test never changes what runs, whatever the order.
os.environ["MEMFIT_CACHE_DIR"] = tempfile.mkdtemp(prefix="memfit-test-cache-")

import pytest  # noqa: E402


from memfit.cli.app import quiet_libraries  # noqa: E402

quiet_libraries()


@pytest.fixture(autouse=True)
def own_cache_dir(tmp_path_factory, monkeypatch):
    """A fresh, empty memfit store for every test."""
    monkeypatch.setenv("MEMFIT_CACHE_DIR", str(tmp_path_factory.mktemp("memfit-cache")))


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
