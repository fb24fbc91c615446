"""SD3 end to end through memfit serve: Stability's all-in-one file (``sd3_medium_incl_clips_t5xxlfp16.safetensors``:
the MMDiT, the VAE and the three text encoders in one file) kept where A1111 keeps it (models/Stable-diffusion/), with
a --config folder of configs and tokenizers only, driven by the real A1111 client library webuiapi. The image it gets
is, byte for byte, what ``memfit generate --model FILE --config DIR`` writes, which is the diffusers folder's image.
ComfyUI's models/checkpoints/ lists the same file the same way. One tiny server, 32x32, 2 steps.
"""

from __future__ import annotations

import base64
import shutil
from pathlib import Path

import pytest

import memfit
from memfit.testing import max_pixel_difference

pytest.importorskip("fastapi", reason="memfit serve needs FastAPI: pip install 'memfit[serve]'")
pytest.importorskip("uvicorn", reason="memfit serve needs uvicorn: pip install 'memfit[serve]'")
pytest.importorskip("httpx", reason="the server fixture polls with httpx: pip install 'memfit[serve]'")
webuiapi = pytest.importorskip("webuiapi", reason="webuiapi (the A1111 client library) is not installed: "
                                                  "pip install 'memfit[test]'")

PROMPTS = {"prompt": "a red house near the sea", "negative_prompt": "blurry"}
SMALL = {"steps": 2, "cfg_scale": 3.5, "width": 32, "height": 32}
FILE_NAME = "sd3_medium_incl_clips_t5xxlfp16.safetensors"


@pytest.fixture(scope="module")
def sd3_models(tiny_models, tmp_path_factory):
    """(A1111 models folder holding the SD3 file, the file, its configs-only folder, the diffusers folder)."""
    from memfit.testing.single_file import save_sd3_checkpoint

    folder = Path(tiny_models("sd3_single_file"))
    root = tmp_path_factory.mktemp("sd3-serve")
    checkpoints = root / "models" / "Stable-diffusion"
    checkpoints.mkdir(parents=True)
    path = save_sd3_checkpoint(folder, checkpoints / FILE_NAME)
    configs = Path(shutil.copytree(folder, root / "sd3-configs", ignore=shutil.ignore_patterns("*.safetensors")))
    return root / "models", path, configs, folder


def _expected(path: Path, configs: Path, seed: int) -> tuple[bytes, object]:
    from memfit.run.media import png_bytes

    result = memfit.generate(PROMPTS["prompt"], model=path, config=configs, negative_prompt=PROMPTS["negative_prompt"],
                             steps=2, guidance=3.5, width=32, height=32, seed=seed, sampler="Euler", progress=False)
    return png_bytes(result.images[0], result.metadata), result


def test_comfyuis_checkpoints_folder_lists_the_file_too(sd3_models, tmp_path):
    from memfit.models.library import ModelsDir, config_folders

    _, path, configs, _ = sd3_models
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / FILE_NAME).symlink_to(path)
    entry = ModelsDir(tmp_path, configs=config_folders([configs])).scan().checkpoints[0]
    assert (entry.name, entry.kind, entry.error, entry.pipeline) == (FILE_NAME, "file", "", "StableDiffusion3Pipeline")


@pytest.mark.slow  # starts a server process
def test_webuiapi_txt2img_on_an_sd3_file_in_a_models_folder(sd3_models, memfit_server):
    root, path, configs, folder = sd3_models
    with memfit_server(None, "--models-dir", str(root), "--config", str(configs)) as (_, url):
        host, port = url.rsplit("//", 1)[1].split(":")
        api = webuiapi.WebUIApi(host=host, port=int(port))
        listed = api.get_sd_models()
        assert [m["model_name"] for m in listed] == [path.stem] and listed[0]["filename"] == str(path)
        assert api.util_get_current_model() in (listed[0]["title"], FILE_NAME)
        api.util_set_model(path.stem)  # by its model_name, as A1111 accepts it
        # SD3 samples with its flow-matching Euler, A1111's "Euler" (webuiapi's default "Euler a" is a DDPM sampler).
        result = api.txt2img(seed=7, sampler_name="Euler", **PROMPTS, **SMALL)
    expected, generated = _expected(path, configs, 7)
    assert base64.b64decode(result.json["images"][0]) == expected
    assert result.info["sampler_name"] == "Euler" and result.info["all_seeds"] == [7]
    reference = memfit.generate(PROMPTS["prompt"], model=folder, negative_prompt=PROMPTS["negative_prompt"], steps=2,
                                guidance=3.5, width=32, height=32, seed=7, sampler="Euler", progress=False)
    assert max_pixel_difference(generated.images, reference.images) == 0
