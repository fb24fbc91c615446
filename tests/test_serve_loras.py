"""memfit serve: AUTOMATIC1111's <lora:NAME:WEIGHT> prompt tags, the LoRA files of --models-dir applied
for that request and gone after it.

The prompt syntax is read by a pure function (memfit.serve.prompt_loras); a request with a tag makes, byte
for byte, what `memfit generate` writes for the prompt without the tag and --lora FILE:WEIGHT; the next
request without one makes the image without the LoRA; a LoRA that is not listed is a 422 naming those that are.
"""

import base64
import importlib.util
import shutil

import pytest

from memfit.serve.prompt_loras import LoraTag, prompt_loras

SMALL = {"steps": 2, "cfg_scale": 3.5, "width": 32, "height": 32, "seed": 3}


def test_tags_are_removed_and_read_as_a1111_reads_them():
    assert prompt_loras("a cat, <lora:style:0.8> on a mat") == ("a cat,  on a mat", [LoraTag("style", 0.8)])
    assert prompt_loras("<lora:style>a cat<lyco:detail:-0.5>") == ("a cat", [LoraTag("style", 1.0),
                                                                            LoraTag("detail", -0.5)])
    # the text encoder's and the denoiser's weights, where they agree; the same LoRA twice is applied twice
    assert prompt_loras("<lora:a:0.5:0.5><lora:a:te=2:unet=2>x") == ("x", [LoraTag("a", 0.5), LoraTag("a", 2.0)])
    assert prompt_loras("no tags, <lora:> <b>") == ("no tags, <lora:> <b>", [])  # not tags: left as written


@pytest.mark.parametrize("prompt, says", [
    ("<hypernet:x:1> a cat", "memfit applies only LoRA tags (<lora:NAME:WEIGHT>), not 'hypernet' networks"),
    ("<lora:style:strong>", "the weight 'strong' is not a number"),
    ("<lora:style:inf>", "the weight must be a finite number"),
    ("<lora:style:0.8:0.2>", "gives the text encoder and the denoiser different weights"),
    ("<lora:style:1:1:1:1>", "is not a LoRA tag memfit reads"),
    ("<lora:style:dyn=4>", "is not a LoRA tag memfit reads"),
])
def test_tags_memfit_cannot_apply_say_why(prompt, says):
    with pytest.raises(ValueError, match=says.replace("(", r"\(").replace(")", r"\)")):
        prompt_loras(prompt)


@pytest.fixture(scope="module")
def served(tiny_models, tmp_path_factory):
    """(client, the LoRA file, the model folder): an A1111 models folder with a tiny Flux and one LoRA for it."""
    if importlib.util.find_spec("peft") is None:
        pytest.skip("LoRAs need peft (pip install memfit[lora])")
    pytest.importorskip("fastapi", reason="memfit serve needs FastAPI: pip install 'memfit[serve]'")
    from fastapi.testclient import TestClient

    from memfit.serve import create_app
    from memfit.serve.checkpoints import Checkpoints
    from memfit.testing.conditioning import save_lora

    root = tmp_path_factory.mktemp("models-dir")
    model = shutil.copytree(tiny_models("flux"), root / "Stable-diffusion" / "tiny-flux")
    (root / "Lora").mkdir()
    lora = shutil.copy(save_lora(model, tmp_path_factory.mktemp("lora"), seed=1), root / "Lora" / "style.safetensors")
    checkpoints = Checkpoints.open(models_dir=root)
    with TestClient(create_app(checkpoints)) as client:
        yield client, lora, model


def _expected(model, prompt, loras=()):
    import memfit
    from memfit.run.media import png_bytes

    result = memfit.generate(prompt, model=model, steps=2, guidance=3.5, width=32, height=32, seed=3, loras=loras,
                             progress=False)
    return png_bytes(result.images[0], result.metadata)


def test_a_lora_tag_applies_the_lora_for_that_request_only(served):
    client, lora, model = served
    styled = client.post("/sdapi/v1/txt2img", json={"prompt": "a red house <lora:style:0.7>", **SMALL})
    assert styled.status_code == 200, styled.text
    assert base64.b64decode(styled.json()["images"][0]) == _expected(model, "a red house ", [(str(lora), 0.7)])
    plain = client.post("/sdapi/v1/txt2img", json={"prompt": "a red house ", **SMALL})
    assert base64.b64decode(plain.json()["images"][0]) == _expected(model, "a red house ")
    assert plain.json()["images"] != styled.json()["images"]


def test_an_unknown_lora_or_tag_is_a_422_naming_the_listed_ones(served):
    client, _, _ = served
    response = client.post("/sdapi/v1/txt2img", json={"prompt": "a cat <lora:nope:1>", **SMALL})
    assert response.status_code == 422
    assert response.json()["detail"] == ("prompt: No LoRA 'nope' is listed; name one of 'style' (GET /sdapi/v1/loras "
                                         "lists them; POST /sdapi/v1/refresh-loras rescans the models folder).")
    response = client.post("/sdapi/v1/txt2img", json={"prompt": "a cat <lora:style:0.8:0.1>", **SMALL})
    assert response.status_code == 422 and "different weights" in response.json()["detail"]
