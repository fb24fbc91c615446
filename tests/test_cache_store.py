"""The cache store's promises: atomic, crash-safe, concurrent-safe, checksummed, bounded."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import memfit.cache
from memfit.cache import CacheCorruptionWarning, CacheKey, CacheMode, CacheStore, compile_key
from memfit.errors import MemfitError

SRC_DIR = str(Path(memfit.cache.__file__).resolve().parents[2])


def run_python(code: str, **kwargs) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=SRC_DIR + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **kwargs,
    )


@pytest.fixture
def store(tmp_path: Path) -> CacheStore:
    return CacheStore(tmp_path / "cache", mode="on")


def key(n: int = 0, kind: str = "test") -> CacheKey:
    return CacheKey(kind, {"weights": f"fp-{n}", "backend": "eager"})


def write_file(name: str, data: bytes, calls: list | None = None):
    """A builder that writes one file (and records each call in ``calls``)."""

    def build(out: Path) -> None:
        if calls is not None:
            calls.append(out)
        (out / name).write_bytes(data)

    return build


# -- keys ----------------------------------------------------------------------------------------


def test_key_digest_depends_on_content_only_not_on_dict_order():
    a = CacheKey("compiled", {"weights": "abc", "inputs": {"x": [1, 4], "dtype": "float32"}})
    b = CacheKey("compiled", {"inputs": {"dtype": "float32", "x": [1, 4]}, "weights": "abc"})
    assert a.digest == b.digest
    assert len(a.digest) == 64
    assert CacheKey("compiled", {"weights": "abd"}).digest != CacheKey("compiled", {"weights": "abc"}).digest
    # The kind is part of the identity: equal parts in two namespaces never collide.
    assert CacheKey("embeddings", {"weights": "abc"}).digest != CacheKey("compiled", {"weights": "abc"}).digest


def test_key_accepts_torch_types_and_rejects_unstable_values():
    torch = pytest.importorskip("torch")
    k = CacheKey("compiled", {"dtype": torch.float16, "shape": torch.Size([1, 4]), "device": torch.device("cpu")})
    assert k.parts == {"dtype": "torch.float16", "shape": [1, 4], "device": "cpu"}
    with pytest.raises(MemfitError, match="JSON values"):
        CacheKey("compiled", {"module": object()})
    with pytest.raises(MemfitError, match="finite"):
        CacheKey("compiled", {"scale": float("nan")})
    with pytest.raises(MemfitError, match="not valid"):
        CacheKey("../escape", {})


def test_compile_key_records_versions_and_is_stable():
    a = compile_key(weights_fingerprint="w1", input_signature=[[1, 4, 8, 8]], backend="eager")
    b = compile_key(weights_fingerprint="w1", input_signature=[[1, 4, 8, 8]], backend="eager")
    c = compile_key(weights_fingerprint="w1", input_signature=[[2, 4, 8, 8]], backend="eager")
    assert a.digest == b.digest != c.digest
    assert a.parts["versions"]["torch"]
    with pytest.raises(MemfitError, match="fingerprint"):
        compile_key(weights_fingerprint="", input_signature=[], backend="eager")


# -- put / get -----------------------------------------------------------------------------------


def test_put_then_get_returns_the_same_files(store: CacheStore, tmp_path: Path):
    source = tmp_path / "model.bin"
    source.write_bytes(b"\x00\x01" * 1000)
    path = store.put(key(), {"graph.json": b'{"a": 1}', "weights/model.bin": source}, meta={"note": "x"})
    assert path is not None
    loaded = store.get(key())
    assert loaded == path
    assert (loaded / "graph.json").read_bytes() == b'{"a": 1}'
    assert (loaded / "weights" / "model.bin").read_bytes() == source.read_bytes()
    assert store.get(key(1)) is None
    [entry] = store.ls()
    assert entry.meta == {"note": "x"} and entry.size == 2000 + 8
    assert entry.parts == {"weights": "fp-0", "backend": "eager"}


def test_put_rejects_names_escaping_the_entry(store: CacheStore):
    with pytest.raises(MemfitError, match="leaves the entry directory"):
        store.put(key(), {"../evil": b"x"})
    assert store.ls() == []


def test_get_or_build_builds_once_then_hits(store: CacheStore):
    calls = []

    def build(out: Path):
        calls.append(out)
        (out / "artifact").write_text("built")
        return {"build_seconds": 0.0}

    first = store.get_or_build(key(), build)
    second = store.get_or_build(key(), build)
    assert first == second and (first / "artifact").read_text() == "built"
    assert len(calls) == 1


def test_a_failing_build_leaves_no_entry_and_no_staging(store: CacheStore):
    def build(out: Path):
        (out / "half").write_text("partial")
        raise RuntimeError("compiler crashed")

    with pytest.raises(RuntimeError, match="compiler crashed"):
        store.get_or_build(key(), build)
    assert store.get(key()) is None
    assert list((store.root / ".tmp").iterdir()) == []


def test_a_build_that_writes_nothing_or_returns_junk_is_an_error(store: CacheStore):
    with pytest.raises(MemfitError, match="wrote no files"):
        store.get_or_build(key(), lambda out: None)
    with pytest.raises(MemfitError, match="returned int"):
        store.get_or_build(key(), lambda out: (out / "f").write_bytes(b"x"))
    assert store.ls() == []


def test_entry_becomes_visible_only_by_rename(store: CacheStore, monkeypatch):
    """While building, nothing exists at the final path; the manifest is written before the rename."""
    seen_during_build = []

    def build(out: Path):
        (out / "f").write_bytes(b"data")
        seen_during_build.append(store.entry_dir(key()).exists())
        assert store.root / ".tmp" in out.parents  # staged on the cache's own filesystem

    renames = []
    real_rename = os.rename

    def spy_rename(src, dst):
        renames.append((Path(src), Path(dst), (Path(src) / "manifest.json").exists()))
        return real_rename(src, dst)

    monkeypatch.setattr(os, "rename", spy_rename)
    store.get_or_build(key(), build)
    assert seen_during_build == [False]
    assert renames == [(renames[0][0], store.entry_dir(key()), True)]


# -- crashes and concurrency ---------------------------------------------------------------------

WRITER = """
    import sys, time
    from pathlib import Path
    from memfit.cache import CacheKey, CacheStore
    store = CacheStore(sys.argv[1], mode="on")
    def build(out):
        with open(out / "big", "wb") as f:
            f.write(b"x" * 1_000_000)
            f.flush()
            print("writing", flush=True)
            time.sleep(60)   # killed here
            f.write(b"y" * 1_000_000)
    store.get_or_build(CacheKey("test", {"weights": "fp-0", "backend": "eager"}), build)
"""


@pytest.mark.slow
def test_writer_killed_mid_write_leaves_nothing_that_loads(store: CacheStore):
    proc = run_python(WRITER.replace("sys.argv[1]", repr(str(store.root))))
    try:
        assert proc.stdout.readline().strip() == "writing", proc.stderr.read()
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
    finally:
        proc.kill()
    staged = list((store.root / ".tmp").iterdir())
    assert len(staged) == 1  # the half-written staging dir is left by the killed writer...
    assert store.get(key()) is None  # ...but nothing loads
    assert store.ls() == []
    # The next build succeeds, and sweeps the abandoned staging dir (its writer is dead).
    path = store.get_or_build(key(), write_file("big", b"ok"))
    assert (path / "big").read_bytes() == b"ok"
    assert not staged[0].exists()


FILLER = """
    import sys, time
    from pathlib import Path
    from memfit.cache import CacheKey, CacheStore
    root, counter = sys.argv[1], Path(sys.argv[2])
    store = CacheStore(root, mode="on")
    def build(out):
        with open(counter, "a") as f:
            f.write("built\\n")
        time.sleep(0.5)   # long enough for the other process to arrive while we build
        (out / "artifact").write_text("content")
    path = store.get_or_build(CacheKey("test", {"weights": "shared"}), build)
    print((path / "artifact").read_text())
"""


@pytest.mark.slow
def test_two_processes_filling_one_key_both_succeed_and_build_once(store: CacheStore, tmp_path: Path):
    counter = tmp_path / "builds.txt"
    code = FILLER.replace("sys.argv[1]", repr(str(store.root))).replace("sys.argv[2]", repr(str(counter)))
    procs = [run_python(code) for _ in range(2)]
    results = [p.communicate(timeout=60) for p in procs]
    for proc, (out, err) in zip(procs, results):
        assert proc.returncode == 0, err
        assert out.strip() == "content"
    assert counter.read_text().count("built") == 1
    assert len(store.ls()) == 1 and store.verify() == []


def test_commit_without_lock_keeps_an_intact_twin(store: CacheStore):
    """Even if the lock were ignored (e.g. a network filesystem), a second commit is harmless."""
    first = store.put(key(), b"same")
    staging = store._new_staging_dir()
    (staging / "data").mkdir()
    (staging / "data" / "blob").write_bytes(b"same")
    assert store._commit(key(), staging, {}) == first
    assert store.verify() == []


# -- corruption ----------------------------------------------------------------------------------


def flip_one_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def test_flipped_byte_is_caught_by_verify_and_by_load_which_rebuilds(store: CacheStore):
    builds = []

    def build(out: Path):
        builds.append(1)
        (out / "weights").write_bytes(bytes(range(256)) * 10)

    path = store.get_or_build(key(), build)
    store.put(key(1), b"untouched")
    flip_one_byte(path / "weights")

    bad = store.verify()
    assert [b.digest for b in bad] == [key().digest]
    assert "checksum" in bad[0].reason and "weights" in bad[0].reason

    with pytest.warns(CacheCorruptionWarning, match=key().digest[:12]):
        rebuilt = store.get_or_build(key(), build)
    assert len(builds) == 2
    assert (rebuilt / "weights").read_bytes() == bytes(range(256)) * 10
    assert store.verify() == []


@pytest.mark.parametrize(
    "damage, reason",
    [
        (lambda entry: (entry / "data" / "blob").write_bytes(b"abc"), "truncated"),
        (lambda entry: (entry / "data" / "blob").unlink(), "missing"),
        (lambda entry: (entry / "data" / "extra").write_bytes(b"?"), "unexpected"),
        (lambda entry: (entry / "manifest.json").write_text("{not json"), "unreadable"),
    ],
)
def test_damaged_entries_are_never_loaded(store: CacheStore, damage, reason):
    store.put(key(), b"abcdef")
    damage(store.entry_dir(key()))
    assert reason in store.verify()[0].reason
    with pytest.warns(CacheCorruptionWarning, match=reason):
        assert store.get(key()) is None
    assert not store.entry_dir(key()).exists()


def test_verify_can_remove_bad_entries(store: CacheStore):
    store.put(key(), b"abcdef")
    flip_one_byte(store.get(key()) / "blob")
    assert len(store.verify(remove_bad=True)) == 1
    assert store.ls() == [] and store.verify() == []


# -- size limit ----------------------------------------------------------------------------------


def test_lru_eviction_under_a_size_limit(tmp_path: Path):
    store = CacheStore(tmp_path, max_bytes=3000, mode="on")
    for n in range(3):
        store.put(key(n), b"x" * 1000)
        time.sleep(0.02)  # distinct last-used times even on coarse filesystem clocks
    assert store.get(key(0)) is not None  # key 0 becomes the most recently used
    time.sleep(0.02)
    store.put(key(3), b"x" * 1000)  # over the limit: the least recently used (key 1) goes
    assert store.contains(key(0)) and not store.contains(key(1))
    assert store.contains(key(2)) and store.contains(key(3))
    assert store.total_bytes() <= 3000


def test_an_entry_larger_than_the_limit_is_kept_with_a_warning(tmp_path: Path):
    store = CacheStore(tmp_path, max_bytes=100, mode="on")
    store.put(key(0), b"x" * 50)
    with pytest.warns(UserWarning, match="MEMFIT_CACHE_MAX_BYTES"):
        store.put(key(1), b"x" * 500)
    assert store.contains(key(1)) and not store.contains(key(0))


def test_size_limit_from_environment(tmp_path: Path, monkeypatch):
    monkeypatch.setenv("MEMFIT_CACHE_MAX_BYTES", "2KiB")
    assert CacheStore(tmp_path).max_bytes == 2048
    monkeypatch.setenv("MEMFIT_CACHE_MAX_BYTES", "lots")
    with pytest.raises(MemfitError, match="MEMFIT_CACHE_MAX_BYTES='lots'"):
        CacheStore(tmp_path)


# -- modes and environment -----------------------------------------------------------------------


def test_cache_off_misses_and_skips_writes(tmp_path: Path, monkeypatch):
    CacheStore(tmp_path, mode="on").put(key(), b"cached")
    monkeypatch.setenv("MEMFIT_CACHE", "0")
    store = CacheStore(tmp_path)
    assert store.mode is CacheMode.OFF
    assert store.get(key()) is None
    assert store.put(key(1), b"new") is None
    built = store.get_or_build(key(2), write_file("f", b"fresh"))
    assert (built / "f").read_bytes() == b"fresh"
    assert store.root not in built.parents  # built outside the store
    assert [e.digest for e in store.ls()] == [key().digest]  # nothing new written


def test_cache_require_raises_on_a_miss_and_serves_hits(tmp_path: Path, monkeypatch):
    CacheStore(tmp_path, mode="on").put(key(), b"cached")
    monkeypatch.setenv("MEMFIT_CACHE", "require")
    store = CacheStore(tmp_path)
    assert (store.get_or_build(key(), lambda out: pytest.fail("must not build")) / "blob").read_bytes() == b"cached"
    with pytest.raises(MemfitError, match="MEMFIT_CACHE=require") as info:
        store.get_or_build(key(1), lambda out: pytest.fail("must not build"))
    assert key(1).digest[:12] in str(info.value) and str(tmp_path) in str(info.value)


def test_unknown_cache_mode_is_an_error_naming_the_choices(tmp_path: Path, monkeypatch):
    monkeypatch.setenv("MEMFIT_CACHE", "sometimes")
    with pytest.raises(MemfitError, match="require"):
        CacheStore(tmp_path)


def test_root_from_environment(tmp_path: Path, monkeypatch):
    monkeypatch.setenv("MEMFIT_CACHE_DIR", str(tmp_path / "here"))
    assert memfit.cache.open_store().root == tmp_path / "here"
    monkeypatch.delenv("MEMFIT_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    if sys.platform.startswith("linux"):
        assert memfit.cache.open_store().root == tmp_path / "xdg" / "memfit"


def test_shared_component_is_stored_once(store: CacheStore):
    """Keys come from content: two pipelines sharing one VAE look up the same entry."""
    base_vae = compile_key(weights_fingerprint="vae-weights", input_signature=[[1, 4, 128, 128]], backend="eager")
    refiner_vae = compile_key(weights_fingerprint="vae-weights", input_signature=[[1, 4, 128, 128]], backend="eager")
    builds = []
    build = write_file("graph", b"vae", calls=builds)
    store.get_or_build(base_vae, build)
    store.get_or_build(refiner_vae, build)
    assert len(builds) == 1 and len(store.ls()) == 1


def test_clear_by_kind(store: CacheStore):
    store.put(key(0, kind="compiled"), b"a")
    store.put(key(1, kind="embeddings"), b"b")
    assert store.clear(kind="compiled") == 1
    assert [e.kind for e in store.ls()] == ["embeddings"]
    assert store.clear() == 1 and store.ls() == []
    with pytest.raises(MemfitError, match="not valid"):
        store.clear(kind="../..")


def test_a_tagged_view_writes_its_tags_into_what_it_builds(store: CacheStore):
    def build(out: Path):
        (out / "artifact").write_text("built")
        return {"build_seconds": 1.0}

    store.tagged(component_weights="fp-9").get_or_build(key(), build)
    store.put(key(1), b"untagged")  # the store itself stays untagged
    metas = {entry.parts["weights"]: entry.meta for entry in store.ls("test")}
    assert metas == {"fp-0": {"build_seconds": 1.0, "component_weights": "fp-9"}, "fp-1": {}}
    # An entry stored untagged (by an older memfit) gets the tags when a tagged view loads it, intact.
    assert store.tagged(component_weights="fp-8").get(key(1)) is not None
    metas = {entry.parts["weights"]: entry.meta for entry in store.ls("test")}
    assert metas["fp-1"] == {"component_weights": "fp-8"} and store.verify() == []
    assert store.get(key(1)).joinpath("blob").read_bytes() == b"untagged"


def test_manifest_records_key_parts_times_sizes_and_checksums(store: CacheStore):
    store.put(key(), {"a": b"123"})
    manifest = json.loads((store.entry_dir(key()) / "manifest.json").read_text())
    assert manifest["parts"] == {"weights": "fp-0", "backend": "eager"}
    assert manifest["digest"] == key().digest
    assert manifest["files"]["a"]["size"] == 3
    # One piece: the sha256 of the file's sha256 (memfit.cache.manifest.sha256_of_file).
    assert manifest["files"]["a"]["sha256"] == hashlib.sha256(hashlib.sha256(b"123").digest()).hexdigest()
    assert manifest["created"] <= time.time()


def test_a_file_of_many_pieces_is_checked_in_every_piece(store: CacheStore, monkeypatch):
    from memfit.cache import manifest as manifest_module

    monkeypatch.setattr(manifest_module, "_PIECE", 1024)
    payload = bytes(range(256)) * 13  # 3328 bytes: three full pieces and a short one
    store.put(key(), {"blob": payload})
    pieces = [payload[i:i + 1024] for i in range(0, len(payload), 1024)]
    expected = hashlib.sha256(b"".join(hashlib.sha256(p).digest() for p in pieces)).hexdigest()
    manifest = json.loads((store.entry_dir(key()) / "manifest.json").read_text())
    assert manifest["files"]["blob"]["sha256"] == expected
    path = store.entry_dir(key()) / "data" / "blob"
    damaged = bytearray(payload)
    damaged[3100] ^= 1  # in the last, short piece
    path.write_bytes(bytes(damaged))
    assert store.get(key()) is None


def test_a_load_hashes_a_file_once_then_only_when_it_changed(store: CacheStore, monkeypatch):
    """A file hashed once is stamped (size, times, inode); later loads trust the stamp until any of it
    changes, even a rewrite of the same size with its modification time set back. `verify` rehashes
    all, so it still finds what no stamp can see: bytes changed under an unchanged stamp."""
    from memfit.cache import manifest as manifest_module

    hashed = []
    real_sha256 = manifest_module.sha256_of_file
    monkeypatch.setattr(manifest_module, "sha256_of_file", lambda path: hashed.append(path) or real_sha256(path))
    monkeypatch.setattr(manifest_module, "_SETTLED_NS", 0)
    store.put(key(), {"blob": b"0123456789"})
    hashed.clear()
    assert store.get(key()) is not None and len(hashed) == 1  # hashed, then stamped
    assert store.get(key()) is not None and len(hashed) == 1  # trusted: no hash

    path = store.entry_dir(key()) / "data" / "blob"
    before = path.stat()
    time.sleep(0.05)  # past the filesystem's time granularity
    path.write_bytes(b"0123456780")
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    with pytest.warns(CacheCorruptionWarning, match="sha256"):
        assert store.get(key()) is None

    store.put(key(), {"blob": b"0123456789"})
    assert store.get(key()) is not None
    path.write_bytes(b"9123456789")
    info = path.stat()  # as if the disk itself had changed it: a stamp that still matches
    stamp = [info.st_size, info.st_mtime_ns, info.st_ctime_ns, info.st_ino, info.st_dev]
    (store.entry_dir(key()) / "verified").write_text(json.dumps({"blob": stamp}))
    hashed.clear()
    assert store.get(key()) is not None and not hashed  # what a stamp cannot see
    assert [bad.reason for bad in store.verify()] == ["blob fails its sha256 checksum (corrupted on disk)"]
    assert len(hashed) == 1


def test_a_file_changed_just_before_it_was_hashed_is_not_stamped(store: CacheStore, monkeypatch):
    """Times tick coarsely: a file written within the last second could change again with the same
    times, so it is hashed on every load until it has settled."""
    from memfit.cache import manifest as manifest_module

    hashed = []
    real_sha256 = manifest_module.sha256_of_file
    monkeypatch.setattr(manifest_module, "sha256_of_file", lambda path: hashed.append(path) or real_sha256(path))
    store.put(key(), {"blob": b"abc"})
    hashed.clear()
    assert store.get(key()) is not None and store.get(key()) is not None
    assert len(hashed) == 2 and not (store.entry_dir(key()) / "verified").exists()
