"""Cache maintenance and headers never mislead (issue 17, item 10)."""

import os

import pytest

from memfit.cache import CacheKey, CacheStore
from memfit.cli.app import main
from memfit.errors import MemfitError
from memfit.safetensors_header import read_header


@pytest.mark.parametrize("command", [["ls"], ["ls", "--json"], ["verify"], ["clear"]])
def test_cache_commands_on_a_file_are_an_error_not_empty(tmp_path, capsys, command):
    path = tmp_path / "cache"
    path.write_text("a file")
    assert main(["cache", "--cache-dir", str(path), *command]) == 2
    err = capsys.readouterr().err
    assert str(path) in err and "is a file" in err and err.strip().count("\n") == 0
    assert path.read_text() == "a file"


def test_a_link_to_a_device_is_not_a_safetensors_file(tmp_path):
    link = tmp_path / "model.safetensors"
    os.symlink("/dev/zero", link)
    with pytest.raises(MemfitError, match="not a regular file"):
        read_header(link)


def test_eviction_and_clear_prune_lock_files(tmp_path):
    store = CacheStore(tmp_path, max_bytes=1500)
    for index in range(5):
        store.put(CacheKey("test", {"i": index}), b"x" * 1000)
    locks = sorted(p.name for p in (tmp_path / ".locks").iterdir())
    assert len(locks) == 1, locks  # only the entry still in the store keeps its lock file
    assert store.clear() == 1
    assert list((tmp_path / ".locks").iterdir()) == []
