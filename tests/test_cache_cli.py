"""`memfit cache ls | verify | clear` through the parser, as the CLI wires it."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from memfit.cli import cache as _cache_cli
from memfit.cache import CacheKey, CacheStore


def run_cli(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="memfit")
    _cache_cli.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(list(argv))
    return args.func(args)


@pytest.fixture
def filled(tmp_path: Path, monkeypatch) -> CacheStore:
    monkeypatch.setenv("MEMFIT_CACHE_DIR", str(tmp_path))
    store = CacheStore(tmp_path, mode="on")
    store.put(CacheKey("compiled", {"weights": "w-unet", "backend": "inductor"}), b"a" * 2048)
    store.put(CacheKey("embeddings", {"prompt": "a lighthouse"}), b"b" * 10)
    return store


def test_ls_json_lists_every_entry(filled: CacheStore, capsys):
    assert run_cli("cache", "ls", "--json") == 0
    listed = json.loads(capsys.readouterr().out)
    assert sorted((e["kind"], e["size"]) for e in listed) == [("compiled", 2048), ("embeddings", 10)]
    assert {e["digest"] for e in listed} == {e.digest for e in filled.ls()}
    assert all("last_used" in e and "summary" in e for e in listed)


def test_ls_table_and_kind_filter(filled: CacheStore, capsys):
    assert run_cli("cache", "ls", "--kind", "compiled") == 0
    out = capsys.readouterr().out
    assert "compiled" in out and "backend=inductor" in out and "2.0 KiB" in out
    assert "embeddings" not in out


def test_verify_exits_nonzero_naming_the_bad_entry(filled: CacheStore, capsys):
    assert run_cli("cache", "verify") == 0
    assert "2 entries verified" in capsys.readouterr().out

    bad_key = CacheKey("compiled", {"weights": "w-unet", "backend": "inductor"})
    blob = filled.entry_dir(bad_key) / "data" / "blob"
    blob.write_bytes(b"a" * 2047 + b"X")
    assert run_cli("cache", "verify") == 1
    err = capsys.readouterr().err
    assert bad_key.digest[:12] in err and "checksum" in err and "--remove" in err

    assert run_cli("cache", "verify", "--remove") == 1
    capsys.readouterr()
    assert run_cli("cache", "verify") == 0


def test_clear_by_kind_then_all(filled: CacheStore, capsys):
    assert run_cli("cache", "clear", "--kind", "embeddings") == 0
    assert "Removed 1 entries of kind 'embeddings'" in capsys.readouterr().out
    assert [e.kind for e in filled.ls()] == ["compiled"]
    assert run_cli("cache", "--cache-dir", str(filled.root), "clear") == 0
    assert filled.ls() == []


def test_maintenance_works_even_when_the_cache_is_switched_off(filled: CacheStore, monkeypatch, capsys):
    monkeypatch.setenv("MEMFIT_CACHE", "0")
    assert run_cli("cache", "ls", "--json") == 0
    assert len(json.loads(capsys.readouterr().out)) == 2


def test_a_subcommand_is_required():
    with pytest.raises(SystemExit):
        run_cli("cache")
