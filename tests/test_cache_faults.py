"""A cache that cannot be used degrades to an uncached run with one warning naming it, unless
MEMFIT_CACHE=require (issue 17, item 3)."""

import warnings

import pytest
from PIL import Image

from memfit.cache import CacheKey, CacheStore, CacheUnavailableWarning
from memfit.cache import store as store_module
from memfit.cli.app import main
from memfit.errors import MemfitError

RUN = ["--prompt", "a red circle", "--steps", "1", "--width", "32", "--height", "32", "--quiet"]


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch):
    monkeypatch.setattr(store_module, "_warned_roots", set())


def _file_in_place(tmp_path):
    root = tmp_path / "cache"
    root.write_text("not a directory")
    return root


def _locks_unwritable(tmp_path):
    root = tmp_path / "cache"
    root.mkdir()
    (root / ".locks").write_text("a file where the lock directory goes")
    (root / ".tmp").write_text("a file where the staging directory goes")
    return root


@pytest.mark.parametrize("make_root", [_file_in_place, _locks_unwritable], ids=["file-in-place", "unwritable"])
def test_store_fault_builds_uncached_with_one_warning(tmp_path, make_root):
    store = CacheStore(make_root(tmp_path))
    key = CacheKey("embeddings", {"prompt": "x"})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = store.get_or_build(key, lambda out: (out / "a").write_bytes(b"1") and None)
        second = store.get_or_build(key, lambda out: (out / "a").write_bytes(b"1") and None)
        assert store.get(key) is None
    assert (first / "a").read_bytes() == b"1" and (second / "a").read_bytes() == b"1"
    faults = [w for w in caught if issubclass(w.category, CacheUnavailableWarning)]
    assert len(faults) == 1 and str(store.root) in str(faults[0].message)


def test_store_fault_is_an_error_under_require(tmp_path):
    store = CacheStore(_locks_unwritable(tmp_path), mode="require")
    with pytest.raises(MemfitError, match="MEMFIT_CACHE=require"):
        store.get_or_build(CacheKey("embeddings", {"prompt": "x"}), lambda out: (out / "a").write_bytes(b"1"))


@pytest.mark.parametrize("make_root", [_file_in_place, _locks_unwritable], ids=["file-in-place", "unwritable"])
def test_generate_with_an_unusable_cache_runs_uncached_with_one_warning(tiny_models, tmp_path, monkeypatch, capsys,
                                                                        make_root):
    root = make_root(tmp_path)
    monkeypatch.setenv("MEMFIT_CACHE_DIR", str(root))
    assert main(["generate", "--model", tiny_models("sd"), *RUN, "--out", str(tmp_path / "a.png")]) == 0
    err = capsys.readouterr().err
    assert err.count("memfit: warning:") == 1 and str(root) in err and "Traceback" not in err, err
    monkeypatch.setenv("MEMFIT_CACHE_DIR", str(tmp_path / "good"))
    assert main(["generate", "--model", tiny_models("sd"), *RUN, "--out", str(tmp_path / "b.png")]) == 0
    assert Image.open(tmp_path / "a.png").tobytes() == Image.open(tmp_path / "b.png").tobytes()


def test_a_full_disk_under_the_cache_runs_uncached_with_one_warning(tiny_models, tmp_path, monkeypatch, capsys):
    """Every file write under the cache directory fails as on a full disk: safetensors' own writer with its
    SafetensorError, Python's with OSError ENOSPC. The run goes on uncached with one warning, and the store
    holds no entry and no staging folder (issue 35, item 9)."""
    import errno
    import os
    import pathlib

    import safetensors.torch
    from safetensors import SafetensorError

    root = tmp_path / "cache"
    monkeypatch.setenv("MEMFIT_CACHE_DIR", str(root))
    write_bytes, save_file = pathlib.Path.write_bytes, safetensors.torch.save_file

    def full_write_bytes(path, data):
        if root in path.parents:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        return write_bytes(path, data)

    def full_save_file(tensors, filename, metadata=None):
        if root in pathlib.Path(filename).parents:
            raise SafetensorError("Error while serializing: IoError(Os { code: 28, kind: StorageFull, "
                                  'message: "No space left on device" })')
        return save_file(tensors, filename, metadata=metadata)

    monkeypatch.setattr(pathlib.Path, "write_bytes", full_write_bytes)
    monkeypatch.setattr(safetensors.torch, "save_file", full_save_file)
    assert main(["generate", "--model", tiny_models("sd"), *RUN, "--out", str(tmp_path / "a.png")]) == 0
    err = capsys.readouterr().err
    assert err.count("memfit: warning:") == 1 and "No space left on device" in err and str(root) in err, err
    assert CacheStore(root).ls() == [] and not list((root / ".tmp").iterdir())


def test_unusable_cache_under_require_is_one_sentence(tiny_models, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MEMFIT_CACHE_DIR", str(_locks_unwritable(tmp_path)))
    monkeypatch.setenv("MEMFIT_CACHE", "require")
    assert main(["generate", "--model", tiny_models("sd"), *RUN, "--out", str(tmp_path / "a.png")]) == 2
    err = capsys.readouterr().err
    assert "MEMFIT_CACHE=require" in err and err.strip().count("\n") == 0
    assert not (tmp_path / "a.png").exists()


@pytest.mark.slow
def test_openvino_with_an_unusable_cache_is_not_a_backend_failure(tiny_models, tmp_path, monkeypatch, capsys):
    pytest.importorskip("openvino")
    root = _locks_unwritable(tmp_path)
    monkeypatch.setenv("MEMFIT_CACHE_DIR", str(root))
    code = main(["generate", "--model", tiny_models("sd"), *RUN, "--backend", "vae=openvino",
                 "--out", str(tmp_path / "a.png"), "--report", str(tmp_path / "r.json")])
    err = capsys.readouterr().err
    assert code == 0, err
    assert err.count("memfit: warning:") == 1 and str(root) in err
    assert '"fallback"' not in (tmp_path / "r.json").read_text()
