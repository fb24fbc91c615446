"""Bad input of every kind gets one sentence: exit 2, naming the thing at fault, no traceback,
no output file, and nothing else changed on disk (issue 17).

One table, one row per fault: folder faults, parameter faults, cache faults and output faults.
Extend it whenever a new flag or file format appears. A row is (id, make, expected): ``make(model,
tmp)`` gets a private copy of the tiny SD folder and a scratch folder, damages what it needs and
returns the extra CLI arguments (and environment) of the run; ``expected`` must appear in the one
line on stderr.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from memfit.cli.app import main

RUN = ["--steps", "1", "--width", "32", "--height", "32", "--quiet"]


def _weights(model: Path, component: str) -> Path:
    return next((model / component).glob("*.safetensors"))


def _edit(model: Path, component: str, change) -> None:
    path = _weights(model, component)
    tensors = load_file(path)
    change(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def _key(tensors, suffix: str) -> str:
    return sorted(k for k in tensors if k.endswith(suffix))[0]


def _index(model: Path, **changes) -> None:
    index = json.loads((model / "model_index.json").read_text())
    index.update(changes)
    (model / "model_index.json").write_text(json.dumps(index))


# -- folder faults ------------------------------------------------------------------------------

def no_unet(model, tmp):
    shutil.rmtree(model / "unet")


def no_vae(model, tmp):
    shutil.rmtree(model / "vae")


def no_unet_config(model, tmp):
    (model / "unet" / "config.json").unlink()


def missing_tensor(model, tmp):
    _edit(model, "unet", lambda t: t.pop(_key(t, "conv_out.weight")))


def missing_text_tensor(model, tmp):
    _edit(model, "text_encoder", lambda t: t.pop(_key(t, "final_layer_norm.weight")))


def extra_tensor(model, tmp):
    _edit(model, "unet", lambda t: t.__setitem__("bogus.weight", torch.zeros(3)))


def mixed_dtypes(model, tmp):
    def change(t):
        key = _key(t, "conv_in.weight")
        t[key] = t[key].half()

    _edit(model, "unet", change)


def wrong_shape(model, tmp):
    def change(t):
        key = _key(t, "conv_in.weight")
        t[key] = torch.zeros(*[n + 1 for n in t[key].shape])

    _edit(model, "unet", change)


def remote_code(model, tmp):
    _index(model, unet=["my_unet", "MyUNet"])


def remote_code_auto_map(model, tmp):
    config = json.loads((model / "unet" / "config.json").read_text())
    config["auto_map"] = {"AutoModel": "modeling_my.MyUNet"}
    (model / "unet" / "config.json").write_text(json.dumps(config))


def pickle_weights(model, tmp):
    path = _weights(model, "text_encoder")
    torch.save(load_file(path), path.with_name("pytorch_model.bin"))
    path.unlink()


CASES = [
    ("no-unet-folder", no_unet, "unet is missing"),
    ("no-vae-folder", no_vae, "vae is missing"),
    ("no-unet-config", no_unet_config, "unet/config.json does not exist"),
    ("missing-tensor", missing_tensor, "has no tensor 'conv_out.weight'"),
    ("missing-text-tensor", missing_text_tensor, "final_layer_norm.weight"),
    ("extra-tensor", extra_tensor, "holds tensor 'bogus.weight'"),
    ("mixed-dtypes", mixed_dtypes, "stores tensor 'conv_in.weight' as float16"),
    ("wrong-shape", wrong_shape, "Tensor 'conv_in.weight' in"),
    ("remote-code", remote_code, "memfit never runs code from a model folder"),
    ("remote-code-auto-map", remote_code_auto_map, "memfit never runs code from a model folder"),
    ("pickle-weights", pickle_weights, "is a pickle checkpoint"),
]


def _snapshot(*roots: Path) -> dict[str, tuple[int, int]]:
    files = {}
    for root in roots:
        for path in sorted(root.rglob("*")) if root.exists() else ():
            if path.is_file():
                stat = path.stat()
                files[str(path)] = (stat.st_size, stat.st_mtime_ns)
    return files


@pytest.fixture
def bad_run(tiny_models, tmp_path, monkeypatch, capsys):
    """Run ``memfit generate`` on a damaged copy of the tiny SD model; returns (code, stderr, out)."""

    def run(make, *, command="generate"):
        model = tmp_path / "model"
        shutil.copytree(tiny_models("sd"), model)
        scratch = tmp_path / "scratch"
        scratch.mkdir()
        extra = make(model, scratch) or {}
        if isinstance(extra, list):
            extra = {"args": extra}
        for name, value in extra.get("env", {}).items():
            monkeypatch.setenv(name, value)
        out = Path(extra.get("out", scratch / "out.png"))
        args = extra.get("args", ["--prompt", "a red circle"])
        before = _snapshot(tmp_path)
        capsys.readouterr()
        code = main([command, "--model", str(model), *RUN, *args, "--out", str(out)])
        err = capsys.readouterr().err
        after = _snapshot(tmp_path)
        # The store may have gained a whole, valid entry from a stage that ran before the fault was
        # found (the prompt's embeddings); never a partial one.
        cache = Path(os.environ["MEMFIT_CACHE_DIR"])
        assert not [p for p in (cache / ".tmp").glob("*")] if (cache / ".tmp").is_dir() else True
        return code, err, out, before, after

    return run


@pytest.mark.parametrize("make, expected", [case[1:] for case in CASES], ids=[case[0] for case in CASES])
def test_bad_input_is_one_sentence_exit_2_and_changes_nothing(bad_run, make, expected):
    code, err, out, before, after = bad_run(make)
    assert code == 2, err
    assert expected in err, err
    assert err.startswith("memfit: error: ") and err.strip().count("\n") == 0, err
    assert "Traceback" not in err
    assert not out.exists()
    assert after == before, "a refused run must leave the disk as it was"
