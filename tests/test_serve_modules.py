"""memfit serve --models-dir: a denoiser alone with several files that fit one of its models, the choice made as
Forge makes it (GET /sdapi/v1/sd-modules, the forge_additional_modules option and override setting).

A ComfyUI folder holds a tiny Chroma transformer alone, its VAE, two T5 files of different weights (both fit its
text_encoder) and one file that fits nothing. The first T5 is paired by default; choosing the second gives, byte for
byte, the image `memfit generate --component text_encoder=FILE` makes with it. One server for the module, 32x32, 2 steps.
"""

from __future__ import annotations

import base64
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import memfit

pytest.importorskip("fastapi", reason="memfit serve needs FastAPI: pip install 'memfit[serve]'")
pytest.importorskip("uvicorn", reason="memfit serve needs uvicorn: pip install 'memfit[serve]'")
httpx = pytest.importorskip("httpx", reason="the server is polled with httpx: pip install 'memfit[serve]'")
webuiapi = pytest.importorskip("webuiapi", reason="webuiapi (the A1111 client library) is not installed: "
                                                  "pip install 'memfit[test]'")

REQUEST = {"prompt": "a red house near the sea", "negative_prompt": "blurry", "steps": 2, "cfg_scale": 3.5,
           "width": 32, "height": 32, "seed": 3, "sampler_name": "Euler"}


def _t5_file(seed: int, path: Path) -> Path:
    """The tiny Chroma pipeline's T5 of ``seed``, as ComfyUI keeps it (no separate embed_tokens copy)."""
    from memfit.testing import build_pipeline
    from memfit.testing.single_file import save_aligned

    state = build_pipeline("chroma", seed=seed).text_encoder.state_dict()
    return save_aligned({k: v.detach() for k, v in state.items() if k != "encoder.embed_tokens.weight"}, path)


@pytest.fixture(scope="module")
def comfyui(tiny_models, tmp_path_factory):
    """(models folder, configs-only folder, {name: file}) for one Chroma denoiser alone and its candidates."""
    import diffusers

    from memfit.testing.single_file import chroma_original_state_dict, ldm_vae_state_dict, save_aligned

    folder = Path(tiny_models("chroma"))
    root = tmp_path_factory.mktemp("comfyui-modules")
    models = root / "models"
    for sub in ("diffusion_models", "vae", "text_encoders"):
        (models / sub).mkdir(parents=True)
    configs = Path(shutil.copytree(folder, root / "chroma-configs", ignore=shutil.ignore_patterns("*.safetensors")))
    pipe = diffusers.DiffusionPipeline.from_pretrained(folder)
    files = {"transformer": save_aligned(chroma_original_state_dict(pipe.transformer),
                                         models / "diffusion_models" / "chroma.safetensors"),
             "vae": save_aligned(ldm_vae_state_dict(pipe.vae), models / "vae" / "ae.safetensors"),
             "first": _t5_file(0, models / "text_encoders" / "t5xxl_a.safetensors"),
             "second": _t5_file(1, models / "text_encoders" / "t5xxl_b.safetensors"),
             "misfit": models / "text_encoders" / "misfit.safetensors"}
    save_file({"w": torch.zeros(1)}, files["misfit"])
    return models, configs, files


@pytest.fixture(scope="module")
def served(comfyui, memfit_server):
    models, configs, _ = comfyui
    mp = pytest.MonkeyPatch()
    mp.setenv("MEMFIT_CACHE", "0")  # each run encodes with the T5 it was given, never a cached embedding of another
    try:
        with memfit_server(None, "--models-dir", str(models), "--config", str(configs)) as (_, url):
            host, port = url.rsplit("//", 1)[1].split(":")
            yield webuiapi.WebUIApi(host=host, port=int(port)), url
    finally:
        mp.undo()


@pytest.fixture
def api(served):
    """The server with no module chosen, as it starts."""
    api, url = served
    assert httpx.post(url + "/sdapi/v1/options", json={"forge_additional_modules": []}, timeout=60).status_code == 200
    return api, url


def _expected_png(comfyui, text_encoder: Path) -> bytes:
    from memfit.run.media import png_bytes

    _, configs, files = comfyui
    result = memfit.generate(REQUEST["prompt"], model=files["transformer"], config=configs,
                             components={"vae": files["vae"], "text_encoder": text_encoder},
                             negative_prompt="blurry", steps=2, guidance=3.5, width=32, height=32, seed=3,
                             sampler="Euler", progress=False)
    return png_bytes(result.images[0], result.metadata)


def _txt2img(url: str, **extra) -> httpx.Response:
    return httpx.post(url + "/sdapi/v1/txt2img", json={**REQUEST, **extra}, timeout=600)


def _png(answer: httpx.Response) -> bytes:
    assert answer.status_code == 200, answer.text
    return base64.b64decode(answer.json()["images"][0])


@pytest.mark.slow
def test_every_fitting_file_is_listed_and_the_first_is_the_default(api, comfyui):
    _, url = api
    _, _, files = comfyui
    modules = httpx.get(url + "/sdapi/v1/sd-modules").json()
    assert modules == [{"model_name": path.name, "filename": str(path)}
                       for path in (files["vae"], files["misfit"], files["first"], files["second"])]
    entry = httpx.get(url + "/memfit/v1/models").json()["checkpoints"][0]
    assert entry["error"] is None and entry["name"] == "diffusion_models/chroma.safetensors"
    assert entry["candidates"] == {"vae": [str(files["vae"])], "text_encoder": [str(files["first"]), str(files["second"])]}
    assert entry["components"] == {"vae": str(files["vae"]), "text_encoder": str(files["first"])}
    assert httpx.get(url + "/sdapi/v1/options").json()["forge_additional_modules"] == []


@pytest.mark.slow
def test_choosing_the_second_text_encoder_in_options_draws_its_image(api, comfyui):
    api, url = api
    _, _, files = comfyui
    first, second = _expected_png(comfyui, files["first"]), _expected_png(comfyui, files["second"])
    assert first != second  # the two files' weights differ, so the choice shows in the image
    assert _png(_txt2img(url)) == first
    api.set_options({"forge_additional_modules": [files["second"].name]})  # by model_name
    assert api.get_options()["forge_additional_modules"] == [str(files["second"])]
    result = api.txt2img(**{k: v for k, v in REQUEST.items()})
    assert base64.b64decode(result.json["images"][0]) == second
    # naming the checkpoint that is selected keeps the choice; by filename, as Forge stores it
    selected = api.util_get_current_model()
    api.set_options({"sd_model_checkpoint": selected})
    assert api.get_options()["forge_additional_modules"] == [str(files["second"])]
    api.set_options({"forge_additional_modules": [str(files["first"])]})
    assert _png(_txt2img(url)) == first


@pytest.mark.slow
def test_choosing_it_in_override_settings_is_for_that_request(api, comfyui):
    _, url = api
    _, _, files = comfyui
    overridden = _txt2img(url, override_settings={"forge_additional_modules": [str(files["second"])]})
    assert _png(overridden) == _expected_png(comfyui, files["second"])
    assert "override_settings.forge_additional_modules" not in overridden.json()["info"]  # acted on, not ignored
    assert httpx.get(url + "/sdapi/v1/options").json()["forge_additional_modules"] == []
    kept = _txt2img(url, override_settings={"forge_additional_modules": ["t5xxl_b.safetensors"]},
                    override_settings_restore_afterwards=False)
    assert _png(kept) == _expected_png(comfyui, files["second"])
    assert httpx.get(url + "/sdapi/v1/options").json()["forge_additional_modules"] == [str(files["second"])]


@pytest.mark.slow
def test_a_file_that_fits_no_slot_or_is_not_listed_is_refused(api, comfyui, tmp_path):
    _, url = api
    _, _, files = comfyui
    for field, send in (("forge_additional_modules", lambda value: httpx.post(
            url + "/sdapi/v1/options", json={"forge_additional_modules": value}, timeout=60)),
                        ("override_settings.forge_additional_modules", lambda value: _txt2img(
                            url, override_settings={"forge_additional_modules": value}))):
        misfit = send(["misfit.safetensors"])
        assert misfit.status_code == 422, misfit.text
        detail = misfit.json()["detail"]
        assert detail.startswith(f"{field}: Module misfit.safetensors") and "text_encoder" in detail and "vae" in detail
        unlisted = send([str(tmp_path / "elsewhere.safetensors")])
        assert unlisted.status_code == 422 and "is not a module file this server lists" in unlisted.json()["detail"]
        both = send([files["first"].name, files["second"].name])  # one slot, two files
        assert both.status_code == 422 and "text_encoder is taken by t5xxl_a.safetensors" in both.json()["detail"]
        assert send("t5xxl_b.safetensors").status_code == 422  # a list is required
    assert httpx.get(url + "/sdapi/v1/options").json()["forge_additional_modules"] == []


@pytest.mark.slow
def test_the_web_page_picks_the_file(api, comfyui, browser):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select, WebDriverWait

    _, url = api
    _, _, files = comfyui
    browser.get(url + "/")
    WebDriverWait(browser, 30).until(lambda b: b.find_elements(By.ID, "module-text_encoder"))
    picker = Select(browser.find_element(By.ID, "module-text_encoder"))
    assert [option.get_attribute("value") for option in picker.options] == [str(files["first"]), str(files["second"])]
    assert picker.first_selected_option.text == "text_encoder: t5xxl_a.safetensors"
    picker.select_by_value(str(files["second"]))
    WebDriverWait(browser, 60).until(lambda b: b.find_element(By.ID, "status").text == "serving t5xxl_b.safetensors")
    assert httpx.get(url + "/sdapi/v1/options").json()["forge_additional_modules"] == [str(files["second"])]
    WebDriverWait(browser, 30).until(lambda b: Select(b.find_element(By.ID, "module-text_encoder"))
                                     .first_selected_option.get_attribute("value") == str(files["second"]))
