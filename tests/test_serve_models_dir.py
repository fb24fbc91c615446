"""memfit serve --models-dir: a user's AUTOMATIC1111 or ComfyUI models folder, listed as A1111 lists it
and switched between by a real A1111 client (webuiapi), each image equal, byte for byte, to what
`memfit generate` writes from that checkpoint.

The folder holds two tiny SD 1.x all-in-one files of different weights (one in a subfolder), a tiny
diffusers folder, a half-copied file, a VAE and a LoRA. One server for the module, 32x32, 2 steps.
"""

from __future__ import annotations

import base64
import hashlib
import json
import shutil
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from memfit.cli.app import main
from memfit.testing.single_file import save_single_file

pytest.importorskip("fastapi", reason="memfit serve needs FastAPI: pip install 'memfit[serve]'")
pytest.importorskip("uvicorn", reason="memfit serve needs uvicorn: pip install 'memfit[serve]'")
httpx = pytest.importorskip("httpx", reason="the server fixture polls with httpx: pip install 'memfit[serve]'")
webuiapi = pytest.importorskip("webuiapi", reason="webuiapi (the A1111 client library) is not installed: "
                                                  "pip install 'memfit[test]'")

PROMPTS = {"prompt": "a red circle", "negative_prompt": "blurry"}
SMALL = {"steps": 2, "cfg_scale": 3.5, "width": 32, "height": 32}
LORA_METADATA = {"ss_output_name": "tiny_style", "ss_tag_frequency": json.dumps({"shapes": {"circle": 3}}),
                 "ss_sd_model_name": "sd15", "ssmd_cover_images": "[]"}


@pytest.fixture(scope="module")
def a1111(tiny_models, tmp_path_factory):
    """(A1111 models folder, the config folder its files take, {name: path} of what it holds)."""
    from memfit.testing import save_pipeline

    config = Path(tiny_models("sd"))
    scratch = tmp_path_factory.mktemp("models-dir")
    root = scratch / "models"
    checkpoints = root / "Stable-diffusion"
    (checkpoints / "sub").mkdir(parents=True)
    paths = {"alpha": save_single_file(config, checkpoints / "alpha.safetensors"),
             "beta": save_single_file(save_pipeline("sd", scratch / "other", seed=1),
                                      checkpoints / "sub" / "beta.safetensors"),
             "diffusers": Path(shutil.copytree(config, checkpoints / "tiny-diffusers"))}
    whole = paths["alpha"].read_bytes()
    (checkpoints / "half-copied.safetensors").write_bytes(whole[:len(whole) // 2])
    (root / "VAE").mkdir()  # beta's VAE (other weights than alpha's), and one of another family (16 latent channels)
    shutil.copy(scratch / "other" / "vae" / "diffusion_pytorch_model.safetensors", root / "VAE" / "tiny-vae.safetensors")
    shutil.copy(Path(tiny_models("flux")) / "vae" / "diffusion_pytorch_model.safetensors",
                root / "VAE" / "flux-vae.safetensors")
    (root / "Lora").mkdir()
    save_file({"lora_unet_down.alpha": torch.ones(1)}, root / "Lora" / "style.safetensors", metadata=LORA_METADATA)
    return root, config, paths


@pytest.fixture(scope="module")
def served(a1111, memfit_server):
    root, config, _ = a1111
    with memfit_server(None, "--models-dir", str(root), "--config", str(config)) as (_, url):
        host, port = url.rsplit("//", 1)[1].split(":")
        yield webuiapi.WebUIApi(host=host, port=int(port)), url


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _models(url: str) -> dict:
    """/memfit/v1/models once every file's hash is known (a background thread reads them)."""
    deadline = time.time() + 60
    while True:
        models = httpx.get(url + "/memfit/v1/models").json()
        if all(c["sha256"] or c["kind"] != "file" or c["error"] for c in models["checkpoints"]) or time.time() > deadline:
            return models
        time.sleep(0.1)


def _title(name: str, path: Path) -> str:
    return f"{name} [{_sha256(path)[:10]}]"


def _expected_png(model: Path, config: Path | None, seed: int, components: dict | None = None) -> bytes:
    """What memfit generate writes from ``model`` for the request webuiapi sends (its default sampler)."""
    import memfit
    from memfit.run.media import png_bytes

    result = memfit.generate(PROMPTS["prompt"], model=model, config=config, negative_prompt=PROMPTS["negative_prompt"],
                             steps=2, guidance=3.5, width=32, height=32, seed=seed, sampler="Euler a", progress=False,
                             components=components)
    return png_bytes(result.images[0], result.metadata)


def _png(result) -> bytes:
    return base64.b64decode(result.json["images"][0])


@pytest.mark.slow
def test_lists_checkpoints_vaes_and_loras_as_a1111_does(served, a1111):
    api, url = served
    root, _, paths = a1111
    models = _models(url)
    listed = api.get_sd_models()
    assert [m["title"] for m in listed] == [_title("alpha.safetensors", paths["alpha"]),
                                            _title("sub/beta.safetensors", paths["beta"]), "tiny-diffusers"]
    assert [m["model_name"] for m in listed] == ["alpha", "sub_beta", "tiny-diffusers"]
    assert listed[0] == {"title": listed[0]["title"], "model_name": "alpha", "hash": _sha256(paths["alpha"])[:10],
                         "sha256": _sha256(paths["alpha"]), "filename": str(paths["alpha"]), "config": None}
    assert listed[2]["hash"] is None and listed[2]["sha256"] is None
    # the first listed is served first; the half-copied file is listed with why, not dropped
    assert api.util_get_current_model() == listed[0]["title"] == models["selected"]
    half = next(c for c in models["checkpoints"] if c["name"] == "half-copied.safetensors")
    assert half["kind"] == "file" and "truncated" in half["error"] and half["pipeline"] is None
    assert api.get_sd_vae() == [{"model_name": name, "filename": str(root / "VAE" / name)}
                                for name in ("flux-vae.safetensors", "tiny-vae.safetensors")]
    lora = api.get_loras()
    assert lora == [{"name": "style", "alias": "tiny_style", "path": str(root / "Lora" / "style.safetensors"),
                     "metadata": {"ss_sd_model_name": "sd15", "ss_tag_frequency": {"shapes": {"circle": 3}},
                                  "ss_output_name": "tiny_style"}}]
    assert list(lora[0]["metadata"]) == ["ss_sd_model_name", "ss_tag_frequency", "ss_output_name"]  # A1111's order


@pytest.mark.slow
def test_switching_with_webuiapi_serves_what_memfit_generate_makes_from_that_file(served, a1111):
    api, url = served
    _, config, paths = a1111
    _models(url)
    titles = api.util_get_model_names()
    beta = _title("sub/beta.safetensors", paths["beta"])
    api.util_set_model(beta)
    assert api.util_get_current_model() == beta
    result = api.txt2img(seed=3, **PROMPTS, **SMALL)
    assert _png(result) == _expected_png(paths["beta"], config, 3)
    assert result.info["sd_model_name"] == "beta" and result.info["sd_model_hash"] == _sha256(paths["beta"])[:10]
    report = httpx.get(url + result.info["memfit"]["report"]).json()
    assert report["warm"]["components"], "the switched-to model is kept warm"

    api.util_set_model("tiny-diffusers")
    assert api.util_get_current_model() == "tiny-diffusers" and "tiny-diffusers" in titles
    assert _png(api.txt2img(seed=3, **PROMPTS, **SMALL)) == _expected_png(paths["diffusers"], None, 3)
    models = httpx.get(url + "/memfit/v1/models").json()
    assert models["selected"] == models["loaded"] == "tiny-diffusers"


@pytest.mark.slow
def test_override_settings_switch_for_one_request_then_back(served, a1111):
    api, url = served
    _, config, paths = a1111
    _models(url)
    alpha = _title("alpha.safetensors", paths["alpha"])
    api.util_set_model(alpha)
    # any name A1111 accepts: here beta's model_name
    once = api.txt2img(seed=5, override_settings={"sd_model_checkpoint": "sub_beta"}, **PROMPTS, **SMALL)
    assert _png(once) == _expected_png(paths["beta"], config, 5) and once.info["memfit"]["ignored_fields"] == []
    assert api.util_get_current_model() == alpha
    back = api.txt2img(seed=5, **PROMPTS, **SMALL)
    assert _png(back) == _expected_png(paths["alpha"], config, 5)
    kept = api.txt2img(seed=5, override_settings={"sd_model_checkpoint": "beta"},
                       override_settings_restore_afterwards=False, **PROMPTS, **SMALL)
    assert _png(kept) == _png(once) and api.util_get_current_model() == _title("sub/beta.safetensors", paths["beta"])


@pytest.mark.slow
def test_only_listed_checkpoints_and_the_own_vae_are_accepted(served, a1111):
    api, url = served
    paths = a1111[2]
    _models(url)
    current = api.util_get_current_model()
    for name in ("nope.safetensors", str(paths["alpha"]), "../models/Stable-diffusion/alpha.safetensors"):
        refused = httpx.post(url + "/sdapi/v1/options", json={"sd_model_checkpoint": name})
        assert refused.status_code == 422 and "No checkpoint" in refused.json()["detail"], name
        assert _title("alpha.safetensors", paths["alpha"]) in refused.json()["detail"]
    half = httpx.post(url + "/sdapi/v1/options", json={"sd_model_checkpoint": "half-copied.safetensors"})
    assert half.status_code == 422 and "cannot be served" in half.json()["detail"] and "truncated" in half.json()["detail"]
    body = {**PROMPTS, **SMALL, "override_settings": {"sd_model_checkpoint": "nope"}}
    assert httpx.post(url + "/sdapi/v1/txt2img", json=body).status_code == 422
    vae = httpx.post(url + "/sdapi/v1/options", json={"sd_vae": "flux-vae.safetensors"})
    assert vae.status_code == 422 and "flux-vae.safetensors" in vae.json()["detail"]
    assert "does not fit" in vae.json()["detail"]  # another family's VAE: what it lacks is named
    body = {**PROMPTS, **SMALL, "override_settings": {"sd_vae": "elsewhere.pt"}}
    assert "not a VAE this server lists" in httpx.post(url + "/sdapi/v1/txt2img", json=body).json()["detail"]
    assert httpx.post(url + "/sdapi/v1/options", json={"sd_vae": "None"}).status_code == 200
    assert api.get_options()["sd_vae"] == "None" and api.util_get_current_model() == current


@pytest.mark.slow
def test_a_listed_vae_file_replaces_the_checkpoints_own(served, a1111):
    """sd_vae naming a VAE file (in options, or for one request in override_settings) makes the image
    `memfit generate --model FILE --component vae=VAE` makes; "None" goes back to the checkpoint's own."""
    api, url = served
    root, config, paths = a1111
    _models(url)
    alpha = _title("alpha.safetensors", paths["alpha"])
    api.util_set_model(alpha)
    assert httpx.post(url + "/sdapi/v1/options", json={"sd_vae": "None"}).status_code == 200
    own = api.txt2img(seed=11, **PROMPTS, **SMALL)
    expected = _expected_png(paths["alpha"], config, 11, {"vae": root / "VAE" / "tiny-vae.safetensors"})
    once = api.txt2img(seed=11, override_settings={"sd_vae": "tiny-vae.safetensors"}, **PROMPTS, **SMALL)
    assert api.get_options()["sd_vae"] == "None"  # restored afterwards, as A1111 does by default
    assert httpx.post(url + "/sdapi/v1/options", json={"sd_vae": "tiny-vae.safetensors"}).status_code == 200
    kept = api.txt2img(seed=11, **PROMPTS, **SMALL)
    assert _png(once) == _png(kept) == expected != _png(own)
    assert httpx.post(url + "/sdapi/v1/options", json={"sd_vae": "None"}).status_code == 200
    assert _png(api.txt2img(seed=11, **PROMPTS, **SMALL)) == _png(own)


@pytest.mark.slow
def test_the_picker_on_the_web_page_switches_the_model(served, a1111, browser):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select, WebDriverWait

    api, url = served
    paths = a1111[2]
    _models(url)
    alpha, beta = _title("alpha.safetensors", paths["alpha"]), _title("sub/beta.safetensors", paths["beta"])
    api.util_set_model(alpha)
    browser.get(url + "/")
    WebDriverWait(browser, 30).until(lambda b: Select(b.find_element(By.ID, "checkpoint")).first_selected_option.text
                                     == alpha)
    picker = Select(browser.find_element(By.ID, "checkpoint"))
    assert [o.text for o in picker.options] == [alpha, beta, "tiny-diffusers", "half-copied.safetensors (cannot be served)"]
    assert not picker.options[3].is_enabled() and "truncated" in picker.options[3].get_attribute("title")
    picker.select_by_visible_text(beta)
    WebDriverWait(browser, 60).until(lambda b: b.find_element(By.ID, "status").text == f"serving {beta}")
    assert api.util_get_current_model() == beta
    for field, value in {**PROMPTS, "steps": "2", "cfg_scale": "3.5", "width": "32", "height": "32", "seed": "8"}.items():
        element = browser.find_element(By.ID, field)
        element.clear()
        element.send_keys(value)
    browser.find_element(By.ID, "go").click()
    WebDriverWait(browser, 120).until(lambda b: b.find_elements(By.ID, "image"))
    shown = base64.b64decode(browser.find_element(By.ID, "image").get_attribute("src").split(",", 1)[1])
    expected = httpx.post(url + "/sdapi/v1/txt2img", json={**PROMPTS, **SMALL, "seed": 8}, timeout=300)
    assert shown == base64.b64decode(expected.json()["images"][0])


@pytest.mark.slow
def test_refresh_lists_a_file_copied_in_after_the_start(served, a1111):
    api, url = served
    root, _, paths = a1111
    copy = root / "Stable-diffusion" / "gamma.safetensors"
    shutil.copy(paths["alpha"], copy)
    assert "gamma.safetensors" not in [m["model_name"] + ".safetensors" for m in api.get_sd_models()]
    api.refresh_checkpoints()
    _models(url)
    assert _title("gamma.safetensors", copy) in api.util_get_model_names()


# ---- the layouts, without a server ---------------------------------------------------------------

def test_a_comfyui_folder_and_a_folder_of_diffusers_folders(a1111, tmp_path):
    from memfit.models.library import ModelsDir, config_folders

    _, config, paths = a1111
    comfy = tmp_path / "ComfyUI" / "models"
    for sub in ("checkpoints", "diffusion_models", "text_encoders", "vae", "loras"):
        (comfy / sub).mkdir(parents=True)
    (comfy / "checkpoints" / "alpha.safetensors").symlink_to(paths["alpha"])
    (comfy / "checkpoints" / "old.ckpt").write_bytes(b"pickle")
    save_file({"double_blocks.0.img_attn.qkv.weight": torch.zeros(2, 2)}, comfy / "diffusion_models" / "flux1.safetensors")
    save_file({"mystery.weight": torch.zeros(2)}, comfy / "checkpoints" / "mystery.safetensors")
    save_file({"w": torch.zeros(1)}, comfy / "text_encoders" / "clip_l.safetensors")
    save_file({"w": torch.zeros(1)}, comfy / "vae" / "ae.safetensors")
    save_file({"w": torch.zeros(1)}, comfy / "loras" / "detail.safetensors")
    # the ComfyUI root is taken for its models/ folder
    listing = ModelsDir(comfy.parent, configs=config_folders([config])).scan()
    found = {entry.name: entry for entry in listing.checkpoints}
    assert list(found) == ["alpha.safetensors", "mystery.safetensors", "old.ckpt", "diffusion_models/flux1.safetensors"]
    assert found["alpha.safetensors"].pipeline == "StableDiffusionPipeline" and not found["alpha.safetensors"].error
    assert "--allow-pickle" in found["old.ckpt"].error
    assert "layout memfit does not recognise" in found["mystery.safetensors"].error
    assert found["diffusion_models/flux1.safetensors"].kind == "split"
    assert found["diffusion_models/flux1.safetensors"].error  # a transformer file that is not one: said why
    assert [v.name for v in listing.vaes] == ["ae.safetensors"] and [lora.name for lora in listing.loras] == ["detail"]

    diffusers = tmp_path / "diffusers-models"
    diffusers.mkdir()
    for name in ("sd-b", "sd-a"):
        (diffusers / name).symlink_to(paths["diffusers"], target_is_directory=True)
    scanned = ModelsDir(diffusers).scan().checkpoints
    assert [(e.name, e.kind, e.pipeline) for e in scanned] == [("sd-a", "diffusers", "StableDiffusionPipeline"),
                                                               ("sd-b", "diffusers", "StableDiffusionPipeline")]


def test_a_file_hash_is_read_once_per_version_of_the_file(tmp_path, monkeypatch):
    from memfit.cache import manifest
    from memfit.cache.file_hash import file_sha256, stored_sha256

    monkeypatch.setattr(manifest, "_SETTLED_NS", 0)  # the file was written a moment ago
    path = tmp_path / "x.safetensors"
    path.write_bytes(b"one")
    assert stored_sha256(path) is None
    assert file_sha256(path) == stored_sha256(path) == hashlib.sha256(b"one").hexdigest()
    time.sleep(0.05)  # past the filesystem's time granularity
    path.write_bytes(b"two")  # rewritten in place: a new version, hashed again
    assert stored_sha256(path) is None and file_sha256(path) == hashlib.sha256(b"two").hexdigest()


@pytest.mark.parametrize("make, says", [
    (lambda root, config: ["--models-dir", str(root / "absent")], "is not a folder"),
    (lambda root, config: ["--models-dir", str(config)], "is one diffusers model folder"),
    (lambda root, config: ["--models-dir", str(root / "empty")], "No checkpoint in"),
    (lambda root, config: ["--models-dir", str(root / "broken")], "truncated"),
    (lambda root, config: ["--models-dir", str(root / "broken"), "--model", "nope"],
     "neither a model path nor a checkpoint"),
    (lambda root, config: ["--models-dir", str(root / "empty"), "--config", str(config), "--config", str(config)],
     "is given twice; give each config folder once"),
    (lambda root, config: ["--model", str(config), "--config", str(config)], "leave --config out"),
])
def test_a_models_folder_with_nothing_to_serve_stops_the_server(a1111, tmp_path, capsys, make, says):
    (tmp_path / "empty" / "Stable-diffusion").mkdir(parents=True)
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "half.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{}")
    assert main(["serve", *make(tmp_path, a1111[1])]) == 2
    assert says in capsys.readouterr().err
