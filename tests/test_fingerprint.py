"""Content fingerprints depend on content, for every weights format (issue 17, item 1)."""

import pytest
import torch

from memfit.cache import fingerprint
from memfit.cache.fingerprint import fingerprint_folder


def _weights(folder, suffix, seed):
    folder.mkdir()
    (folder / "config.json").write_text('{"hidden_size": 8}')
    torch.manual_seed(seed)
    torch.save({"linear.weight": torch.randn(64, 64)}, folder / f"pytorch_model{suffix}")
    return folder


@pytest.mark.parametrize("suffix", [".bin", ".pt", ".ckpt", ".pth"])
@pytest.mark.parametrize("sampled", [False, True], ids=["full", "sampled"])
def test_same_size_pickle_weights_of_two_models_fingerprint_differently(tmp_path, monkeypatch, suffix, sampled):
    if sampled:  # the large-file path: evenly spaced blocks instead of every byte
        monkeypatch.setattr(fingerprint, "FULL_HASH_LIMIT", 1024)
        monkeypatch.setattr(fingerprint, "SAMPLE_BYTES", 256)
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
