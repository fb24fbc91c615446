"""Content fingerprints depend on every byte of the content, for every weights format (issue 17, item 1;
issue 35, item 1), and a large file is read once per version of it."""

import os
import shutil

import pytest
import torch
from safetensors.torch import save_file

from memfit.cache import fingerprint, manifest
from memfit.cache.fingerprint import fingerprint_folder, fingerprint_tensors
from memfit.safetensors_header import read_header


def _weights(folder, suffix, seed):
    folder.mkdir()
    (folder / "config.json").write_text('{"hidden_size": 8}')
    torch.manual_seed(seed)
    torch.save({"linear.weight": torch.randn(64, 64)}, folder / f"pytorch_model{suffix}")
    return folder


@pytest.mark.parametrize("suffix", [".bin", ".pt", ".ckpt", ".pth"])
@pytest.mark.parametrize("stored", [False, True], ids=["read", "stored"])
def test_same_size_pickle_weights_of_two_models_fingerprint_differently(tmp_path, monkeypatch, suffix, stored):
    if stored:  # the large-file path: the file's digest kept in the store
        monkeypatch.setattr(fingerprint, "STORED_DIGEST_BYTES", 1024)
    a, b = _weights(tmp_path / "a", suffix, 0), _weights(tmp_path / "b", suffix, 1)
    sizes = {p.stat().st_size for p in (*a.glob("pytorch_model*"), *b.glob("pytorch_model*"))}
    assert len(sizes) == 1, "the two files must have the same size for this test to mean anything"
    assert fingerprint_folder(a) != fingerprint_folder(b)
    assert fingerprint_folder(a) == fingerprint_folder(_weights(tmp_path / "a2", suffix, 0))


def test_gguf_weights_fingerprint_by_content(tmp_path):
    for name, fill in (("a", b"\1"), ("b", b"\2")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "model.gguf").write_bytes(b"GGUF" + fill * 4096)
    assert fingerprint_folder(tmp_path / "a") != fingerprint_folder(tmp_path / "b")


def _flip(path, offset):
    """Change one byte of ``path`` in place, keeping its size."""
    with path.open("r+b") as handle:
        handle.seek(offset)
        byte = handle.read(1)
        handle.seek(offset)
        handle.write(bytes([byte[0] ^ 1]))


# 8 MiB of weights: sampled as memfit once did (64 blocks of 64 KiB, 128 KiB apart), a byte 100 KiB in sat
# in no block, and a model changed there kept its old fingerprint.
WEIGHTS = {"linear.weight": torch.zeros(2048, 1024)}
UNSAMPLED = 100 * 1024 + 8


@pytest.mark.parametrize("fingerprint_of", [
    lambda path: fingerprint_folder(path.parent),
    lambda path: fingerprint_tensors(path, ["linear.weight"], b"{}"),
], ids=["folder", "single-file-component"])
def test_a_large_file_changed_anywhere_changes_its_fingerprint(tmp_path, monkeypatch, fingerprint_of):
    monkeypatch.setattr(fingerprint, "STORED_DIGEST_BYTES", 1024 * 1024)
    (tmp_path / "unet").mkdir()
    path = tmp_path / "unet" / "model.safetensors"
    save_file(WEIGHTS, path)
    before = fingerprint_of(path)
    _flip(path, read_header(path).data_start + UNSAMPLED)
    assert fingerprint_of(path) != before


def test_a_large_file_is_read_once_per_version_of_it(tmp_path, monkeypatch):
    """The digest is kept in the store by the file's path, size, times and inode: another run (this process's
    memory emptied) reads nothing; a rewrite of the same size with its modification time set back is read."""
    from memfit.cache import file_hash

    monkeypatch.setattr(fingerprint, "STORED_DIGEST_BYTES", 1024 * 1024)
    monkeypatch.setattr(manifest, "_SETTLED_NS", 0)  # these files were written a moment ago
    reads = []
    real_sha256 = file_hash._sha256
    monkeypatch.setattr(file_hash, "_sha256", lambda handle: reads.append(handle.name) or real_sha256(handle))
    (tmp_path / "unet").mkdir()
    path = tmp_path / "unet" / "model.safetensors"
    save_file(WEIGHTS, path)
    first = fingerprint_folder(tmp_path / "unet")
    monkeypatch.setattr(file_hash, "_known", {})  # a later run: only the store remembers
    assert fingerprint_folder(tmp_path / "unet") == first and len(reads) == 1

    info = path.stat()
    _flip(path, read_header(path).data_start + UNSAMPLED)
    os.utime(path, ns=(info.st_atime_ns, info.st_mtime_ns))
    assert fingerprint_folder(tmp_path / "unet") != first and len(reads) == 2


def test_embeddings_made_by_another_text_encoder_are_refused(tiny_models, tmp_path, monkeypatch, capsys):
    """`generate --embeddings` compares the text encoders' fingerprints: one byte of their weights tells them apart."""
    from memfit.cli.app import main
    from memfit.models.folder import ModelFolder
    from memfit.run.embeddings import Embeddings

    monkeypatch.setattr(fingerprint, "STORED_DIGEST_BYTES", 1024)
    model = shutil.copytree(tiny_models("sd"), tmp_path / "model")
    made_by = ModelFolder.open(model).text_fingerprint
    Embeddings({"prompt_embeds": torch.zeros(1, 77, 32)}, "StableDiffusionPipeline", made_by, "a red circle",
               None).save(tmp_path / "e.safetensors")
    weights = next((model / "text_encoder").glob("*.safetensors"))
    header = read_header(weights)
    _flip(weights, header.data_start + (header.size - header.data_start) * 3 // 128)  # between two old samples
    assert main(["generate", "--model", str(model), "--embeddings", str(tmp_path / "e.safetensors"),
                 "--out", str(tmp_path / "out.png"), "--quiet"]) == 2
    assert "were made by a different text encoder" in capsys.readouterr().err
