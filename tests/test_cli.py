"""The memfit command: happy paths, and one clear sentence (exit 2, no traceback, no file) for bad input."""

import json
import os
import shutil
import subprocess
import sys

import pytest
from PIL import Image

from memfit.cli.app import main

pytestmark = pytest.mark.slow  # runs whole pipelines, often in fresh processes

ARGS = ["--steps", "2", "--width", "32", "--height", "32", "--quiet"]


def run_cli(*argv):
    """Run the CLI in a subprocess, as a user would."""
    return subprocess.run([sys.executable, "-m", "memfit", *argv], capture_output=True, text=True, timeout=300)


def test_generate_writes_png_with_metadata_and_report(tiny_models, tmp_path):
    out, report = tmp_path / "img.png", tmp_path / "report.json"
    code = main(["generate", "--model", tiny_models("sd"), "--prompt", "a red circle", "--negative-prompt", "blurry",
                 "--guidance", "3.5", "--seed", "11", *ARGS, "--out", str(out), "--report", str(report)])
    assert code == 0
    umask = os.umask(0)
    os.umask(umask)
    assert out.stat().st_mode & 0o777 == 0o666 & ~umask, "written like any new file, not 0600 like a temp file"
    text = Image.open(out).text
    assert text["prompt"] == "a red circle" and text["negative_prompt"] == "blurry"
    assert (text["seed"], text["steps"], text["guidance"], text["width"], text["height"]) == ("11", "2", "3.5", "32", "32")
    assert text["model"] == tiny_models("sd") and text["memfit_version"]
    stages = json.loads(report.read_text())["stages"]
    assert [s["stage"] for s in stages] == ["encode", "denoise", "decode"]
    assert stages[0]["components"] == ["tokenizer", "text_encoder"]
    assert all(s["peak_bytes"] > 0 and s["seconds"] > 0 for s in stages)


def test_encode_then_generate_from_embeddings_equals_direct_generate(tiny_models, tmp_path):
    model = tiny_models("sd")
    emb = tmp_path / "e.safetensors"
    assert main(["encode", "--model", model, "--prompt", "a red circle", "--negative-prompt", "blurry", "--out", str(emb), "--quiet"]) == 0
    from safetensors import safe_open

    with safe_open(str(emb), "pt") as handle:
        meta = handle.metadata()
    assert meta["prompt"] == "a red circle" and json.loads(meta["negative_prompt"]) == "blurry"
    assert json.loads(meta["shapes"])["prompt_embeds"][1] == 77 and len(meta["text_fingerprint"]) == 64
    assert main(["generate", "--model", model, "--embeddings", str(emb), *ARGS, "--out", str(tmp_path / "a.png")]) == 0
    assert main(["generate", "--model", model, "--prompt", "a red circle", "--negative-prompt", "blurry", *ARGS, "--out", str(tmp_path / "b.png")]) == 0
    assert list(Image.open(tmp_path / "a.png").getdata()) == list(Image.open(tmp_path / "b.png").getdata())


def _other_text_encoder(tiny_models, tmp_path):
    from memfit.testing import save_pipeline

    return str(save_pipeline("sd", tmp_path / "other", seed=123))


def _truncated_weights(tiny_models, tmp_path):
    copy = tmp_path / "broken"
    shutil.copytree(tiny_models("sd"), copy)
    weights = next((copy / "unet").glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    return str(copy)


def _not_diffusers(tiny_models, tmp_path):
    (tmp_path / "plain").mkdir()
    return str(tmp_path / "plain")


def _unsupported(tiny_models, tmp_path):
    copy = tmp_path / "unsupported"
    shutil.copytree(tiny_models("sd"), copy)
    index = json.loads((copy / "model_index.json").read_text())
    index["_class_name"] = "KandinskyPipeline"
    (copy / "model_index.json").write_text(json.dumps(index))
    return str(copy)


@pytest.mark.parametrize(
    "make_model, extra, expected",
    [
        (lambda t, p: str(p / "missing"), ["--prompt", "x"], "does not exist"),
        (_not_diffusers, ["--prompt", "x"], "not a diffusers model folder"),
        (_unsupported, ["--prompt", "x"], "expected ['movq'"),
        (_truncated_weights, ["--prompt", "x"], "is truncated"),
        (lambda t, p: t("sd"), ["--prompt", "   "], "prompt is empty"),
        (lambda t, p: t("sd"), ["--prompt", "x", "--width", "36"], "not a positive multiple of 8"),
        (lambda t, p: t("lumina2"), ["--prompt", "x", "--width", "40"], "not a positive multiple of 16"),
    ],
    ids=["missing", "not-diffusers", "wrong-components", "truncated-weights", "empty-prompt", "bad-size", "bad-size-lumina2"],
)
def test_bad_input_is_one_sentence_and_leaves_no_file(tiny_models, tmp_path, make_model, extra, expected):
    out = tmp_path / "out.png"
    model = make_model(tiny_models, tmp_path)
    result = run_cli("generate", "--model", model, "--steps", "1", "--quiet", *extra, "--out", str(out))
    assert result.returncode == 2, result.stderr
    assert expected in result.stderr
    assert "Traceback" not in result.stderr
    assert result.stderr.strip().count("\n") == 0, result.stderr
    assert not out.exists() and not list(tmp_path.glob(".out.png*"))


def test_embeddings_from_another_model_or_truncated_are_refused(tiny_models, tmp_path):
    emb = tmp_path / "e.safetensors"
    assert main(["encode", "--model", tiny_models("sd"), "--prompt", "a cat", "--out", str(emb), "--quiet"]) == 0
    other = _other_text_encoder(tiny_models, tmp_path)
    result = run_cli("generate", "--model", other, "--embeddings", str(emb), *ARGS, "--out", str(tmp_path / "o.png"))
    assert result.returncode == 2 and "different text encoder" in result.stderr and "Traceback" not in result.stderr
    emb.write_bytes(emb.read_bytes()[:-100])
    result = run_cli("generate", "--model", tiny_models("sd"), "--embeddings", str(emb), *ARGS, "--out", str(tmp_path / "o.png"))
    assert result.returncode == 2 and "truncated" in result.stderr
    assert not (tmp_path / "o.png").exists()


def test_debug_shows_the_traceback(tmp_path):
    result = run_cli("--debug", "generate", "--model", str(tmp_path / "missing"), "--prompt", "x")
    assert result.returncode != 0 and "Traceback" in result.stderr
