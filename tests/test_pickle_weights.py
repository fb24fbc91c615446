"""Pickle checkpoints: refused by default, loaded with torch's weights_only loader under --allow-pickle (issue 17, item 5)."""

import os
import shutil

import torch
from PIL import Image
from safetensors.torch import load_file

from memfit.cli.app import main

RUN = ["--prompt", "a red circle", "--steps", "1", "--width", "32", "--height", "32", "--quiet"]


def _pickled_copy(tiny_models, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(tiny_models("sd"), model)
    path = model / "text_encoder" / "model.safetensors"
    torch.save(load_file(path), path.with_name("pytorch_model.bin"))
    path.unlink()
    return model


class _RunsCode:
    def __reduce__(self):
        return (os.system, ("touch pwned",))


def test_allow_pickle_loads_the_same_weights(tiny_models, tmp_path, capsys):
    model = _pickled_copy(tiny_models, tmp_path)
    assert main(["generate", "--model", str(model), *RUN, "--out", str(tmp_path / "p.png")]) == 2
    assert "--allow-pickle" in capsys.readouterr().err
    assert main(["generate", "--model", str(model), *RUN, "--allow-pickle", "--out", str(tmp_path / "p.png")]) == 0
    assert main(["generate", "--model", tiny_models("sd"), *RUN, "--out", str(tmp_path / "s.png")]) == 0
    assert Image.open(tmp_path / "p.png").tobytes() == Image.open(tmp_path / "s.png").tobytes()


def test_allow_pickle_never_runs_code_from_the_file(tiny_models, tmp_path, capsys, monkeypatch):
    model = _pickled_copy(tiny_models, tmp_path)
    path = model / "text_encoder" / "pytorch_model.bin"
    state = torch.load(path, weights_only=True)
    state["evil"] = _RunsCode()
    torch.save(state, path)
    monkeypatch.chdir(tmp_path)
    code = main(["generate", "--model", str(model), *RUN, "--allow-pickle", "--out", str(tmp_path / "p.png")])
    err = capsys.readouterr().err
    assert code == 2 and str(path.parent) in err and "Traceback" not in err, err
    assert not (tmp_path / "pwned").exists() and not (tmp_path / "p.png").exists()


def test_legacy_format_pickles_pass_the_weights_only_check(tmp_path):
    from memfit.models.folder import ModelFolder

    (tmp_path / "model_index.json").write_text('{"_class_name": "StableDiffusionPipeline", "text_encoder": ["transformers", "CLIPTextModel"]}')
    (tmp_path / "text_encoder").mkdir()
    (tmp_path / "text_encoder" / "config.json").write_text("{}")
    torch.save({"w": torch.ones(2)}, tmp_path / "text_encoder" / "pytorch_model.bin", _use_new_zipfile_serialization=False)
    folder = ModelFolder.open(tmp_path)
    folder.allow_pickle = True
    folder.check_weights(["text_encoder"])  # torch's mmap cannot read the legacy format; the check must still pass


def test_batch_refuses_a_pickle_checkpoint_up_front_and_loads_it_with_allow_pickle(tiny_models, tmp_path, capsys):
    model = _pickled_copy(tiny_models, tmp_path)
    jobs = tmp_path / "jobs.jsonl"
    jobs.write_text('{"id": "a", "prompt": "a red circle"}\n')
    batch = ["batch", str(jobs), "--model", str(model), "--steps", "1", "--width", "32", "--height", "32", "--quiet"]
    assert main([*batch, "--out", str(tmp_path / "refused")]) == 2
    assert "--allow-pickle" in capsys.readouterr().err and not (tmp_path / "refused").exists()
    assert main([*batch, "--out", str(tmp_path / "out"), "--allow-pickle"]) == 0
    assert main(["generate", "--model", tiny_models("sd"), *RUN, "--seed", "0", "--out", str(tmp_path / "s.png")]) == 0
    assert Image.open(tmp_path / "out" / "a.png").tobytes() == Image.open(tmp_path / "s.png").tobytes()


def test_serve_refuses_a_pickle_checkpoint_before_serving_and_loads_it_with_allow_pickle(tiny_models, tmp_path,
                                                                                        capsys, monkeypatch):
    import uvicorn
    from fastapi.testclient import TestClient

    answers = []

    def serve_one_request(server):  # instead of listening: one txt2img request through the app
        with TestClient(server.config.app) as client:
            answers.append(client.post("/sdapi/v1/txt2img", json={"prompt": "a red circle", "steps": 1, "width": 32,
                                                                  "height": 32}))

    monkeypatch.setattr(uvicorn.Server, "run", serve_one_request)
    model = _pickled_copy(tiny_models, tmp_path)
    assert main(["serve", "--model", str(model), "--budget", "none"]) == 2
    assert "--allow-pickle" in capsys.readouterr().err and not answers
    assert main(["serve", "--model", str(model), "--budget", "none", "--allow-pickle"]) == 0
    assert [answer.status_code for answer in answers] == [200], answers[0].text
