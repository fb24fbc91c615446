"""memfit serve driven by a real AUTOMATIC1111 client library: webuiapi (PyPI), constructed with its
defaults (sampler "Euler a", scheduler "automatic", 20 steps), against `memfit serve` on loopback.

Every image it gets equals, byte for byte, what memfit.generate makes from the same inputs; every
other call it makes gets A1111's shape; what memfit cannot do is a 422 naming what it can.
One server for the module, 32x32 images and 2 steps: it runs in CI on every change.
"""

import base64

import pytest
from PIL import Image

pytest.importorskip("fastapi", reason="memfit serve needs FastAPI: pip install 'memfit[serve]'")
pytest.importorskip("uvicorn", reason="memfit serve needs uvicorn: pip install 'memfit[serve]'")
pytest.importorskip("httpx", reason="the server fixture polls with httpx: pip install 'memfit[serve]'")
webuiapi = pytest.importorskip("webuiapi", reason="webuiapi (the A1111 client library) is not installed: "
                                                  "pip install 'memfit[test]'")

pytestmark = pytest.mark.slow  # starts a server process

PROMPTS = {"prompt": "a red circle", "negative_prompt": "blurry"}
SMALL = {"steps": 2, "cfg_scale": 3.5, "width": 32, "height": 32}


@pytest.fixture(scope="module")
def api(tiny_models, memfit_server):
    with memfit_server(tiny_models("sd")) as (_, url):
        host, port = url.rsplit("//", 1)[1].split(":")
        yield webuiapi.WebUIApi(host=host, port=int(port))


def expected_png(tiny_models, seed, **inputs):
    """What memfit.generate writes for the request webuiapi sent (its default sampler included)."""
    import memfit
    from memfit.run.media import png_bytes

    result = memfit.generate(PROMPTS["prompt"], model=tiny_models("sd"), negative_prompt=PROMPTS["negative_prompt"],
                             steps=2, guidance=3.5, width=32, height=32, seed=seed, sampler="Euler a", progress=False,
                             **inputs)
    return png_bytes(result.images[0], result.metadata)


def sent_png(result) -> bytes:
    return base64.b64decode(result.json["images"][0])


def test_txt2img_then_png_info_of_its_image(api, tiny_models):
    result = api.txt2img(seed=7, **PROMPTS, **SMALL)
    assert sent_png(result) == expected_png(tiny_models, 7)
    assert result.info["sampler_name"] == "Euler a" and result.info["all_seeds"] == [7]
    # every field webuiapi sends with its defaults changes nothing in A1111 either
    assert result.info["memfit"]["ignored_fields"] == []

    read = api.png_info(result.image)
    assert read.info == result.info["infotexts"][0]
    shown = ("Prompt", "Negative prompt", "Steps", "Sampler", "Seed", "Size-1")
    assert {key: read.parameters[key] for key in shown} == {
        "Prompt": "a red circle", "Negative prompt": "blurry", "Steps": "2", "Sampler": "Euler a", "Seed": "7",
        "Size-1": "32"}
    assert read.json["items"]["seed"] == "7" and "parameters" not in read.json["items"]


def test_img2img_and_inpainting_equal_memfit_generate(api, tiny_models):
    from memfit.testing.conditioning import test_image, test_mask

    image = test_image(32, seed=1)
    result = api.img2img(images=[image], seed=5, denoising_strength=0.6, **PROMPTS, **SMALL)
    assert sent_png(result) == expected_png(tiny_models, 5, image=image, strength=0.6)
    assert result.info["memfit"]["ignored_fields"] == []

    mask = test_mask(32)
    inpainted = api.img2img(images=[image], mask_image=mask, seed=11, denoising_strength=0.9, **PROMPTS, **SMALL)
    assert sent_png(inpainted) == expected_png(tiny_models, 11, image=image, mask=mask, strength=0.9)
    # webuiapi's inpainting defaults that would change A1111's image, reported rather than dropped
    assert inpainted.info["memfit"]["ignored_fields"] == ["inpaint_full_res", "inpainting_fill", "mask_blur"]


def test_png_info_of_an_a1111_image_and_of_no_image(api):
    image = Image.new("RGB", (8, 8))
    image.info["parameters"] = ("a lighthouse, at dusk\nsecond line\nNegative prompt: blurry\nSteps: 20, "
                                "Sampler: DPM++ 2M, Schedule type: Karras, CFG scale: 7, Seed: 42, Size: 512x768, "
                                'Model: "my, model"')
    read = api.png_info(image)
    assert read.info == image.info["parameters"]
    assert read.parameters == {"Prompt": "a lighthouse, at dusk\nsecond line", "Negative prompt": "blurry",
                               "Steps": "20", "Sampler": "DPM++ 2M", "Schedule type": "Karras", "CFG scale": "7",
                               "Seed": "42", "Size-1": "512", "Size-2": "768", "Model": "my, model"}
    plain = api.png_info(Image.new("RGB", (8, 8)))
    assert plain.info == "" and plain.parameters == {}
    refused = api.session.post(f"{api.baseurl}/png-info", json={"image": base64.b64encode(b"not a picture").decode()})
    assert refused.status_code == 422 and "image is not an image" in refused.json()["detail"]


def test_the_lists_flags_memory_and_no_op_calls(api):
    samplers = api.get_samplers()
    assert {"Euler", "Euler a", "DPM++ 2M", "DDIM"} <= {s["name"] for s in samplers}
    assert next(s for s in samplers if s["name"] == "Euler a")["aliases"] == ["k_euler_a", "k_euler_ancestral"]
    assert api.util_get_scheduler_names() == sorted(["automatic", "karras", "exponential", "sgm_uniform", "simple"])
    karras = next(s for s in api.get_schedulers() if s["name"] == "karras")
    assert karras == {"name": "karras", "label": "Karras", "aliases": None, "default_rho": 7.0,
                      "need_inner_model": False}
    assert api.util_get_sampler_names() == sorted(s["name"] for s in samplers)
    assert [u["name"] for u in api.get_upscalers()] == ["None", "Lanczos", "Nearest"]
    assert api.get_loras() == [] and api.get_sd_vae() == [] and api.get_embeddings() == {"loaded": {}, "skipped": {}}
    for empty in (api.get_hypernetworks, api.get_face_restorers, api.get_realesrgan_models, api.get_prompt_styles,
                  api.get_latent_upscale_modes):
        assert empty() == []
    assert api.get_scripts() == {"txt2img": [], "img2img": []}
    assert api.refresh_checkpoints() is None
    assert api.session.post(f"{api.baseurl}/refresh-loras").status_code == 200

    assert api.util_get_model_names() == ["sd"] and api.util_get_current_model() == "sd"
    api.util_set_model("SD")  # the closest title: the one model this server has
    flags = api.get_cmd_flags()
    assert flags["port"] == int(api.baseurl.rsplit(":", 1)[1].split("/")[0]) and flags["api_auth"] is None
    assert flags["listen"] is False and flags["model"].endswith("sd") and flags["max_steps"] == 150

    memory = api.get_memory()
    assert memory["ram"]["total"] >= memory["ram"]["used"] > 0 and memory["ram"]["free"] > 0
    if flags["device"] == "cpu":
        assert list(memory["cuda"]) == ["error"]
    else:
        assert memory["cuda"]["system"]["total"] > 0

    api.util_wait_for_ready(check_interval=0.1)  # idle: returns at once
    assert api.interrupt() == {} and api.skip() == {}


def test_extra_single_image_resizes_as_a1111_does(api):
    from memfit.testing.conditioning import test_image

    image = test_image(20, seed=3)
    unchanged = api.extra_single_image(image)  # upscaler_1 "None": A1111 leaves the image as it is
    assert unchanged.image.size == (20, 20) and unchanged.image.tobytes() == image.tobytes()
    lanczos = api.extra_single_image(image, upscaler_1="Lanczos", upscaling_resize=2)
    assert lanczos.image.tobytes() == image.resize((40, 40), Image.Resampling.LANCZOS).tobytes()
    assert lanczos.info == "<p>Postprocess upscale by: 2.0, Postprocess upscaler: Lanczos</p>"
    assert lanczos.image.info["postprocessing"] == "Postprocess upscale by: 2.0, Postprocess upscaler: Lanczos"
    # 21 x 2 = 42 is rounded down to a multiple of 8: a second Lanczos resize, as in A1111
    odd = test_image(21, seed=3)
    twice = api.extra_single_image(odd, upscaler_1="Nearest", upscaling_resize=2)
    expected = odd.resize((42, 42), Image.Resampling.NEAREST).resize((40, 40), Image.Resampling.LANCZOS)
    assert twice.image.tobytes() == expected.tobytes()
    to_size = api.extra_single_image(image, upscaler_1="Lanczos", resize_mode=1, upscaling_resize_w=48,
                                     upscaling_resize_h=32)
    assert to_size.image.size == (48, 32) and "Postprocess crop to: 48x32" in to_size.info
    with pytest.raises(RuntimeError) as refused:
        api.extra_single_image(image, upscaler_1="R-ESRGAN 4x+")
    assert refused.value.args[0] == 422 and "use one of: None, Lanczos, Nearest" in refused.value.args[1]


def test_names_memfit_cannot_follow_are_422s_naming_those_it_can_and_start_no_job(api):
    with pytest.raises(RuntimeError) as sampler:
        api.txt2img(sampler_name="DPM fast", **PROMPTS, **SMALL)
    assert sampler.value.args[0] == 422 and "use one of: Euler, Euler a, LMS" in sampler.value.args[1]
    with pytest.raises(RuntimeError) as scheduler:
        api.txt2img(scheduler="polyexponential", **PROMPTS, **SMALL)
    assert scheduler.value.args[0] == 422 and "use one of: automatic, karras" in scheduler.value.args[1]
    body = {**PROMPTS, **SMALL, "sampler_name": "Euler a", "scheduler": "Align Your Steps", "force_task_id": "nope"}
    assert api.session.post(f"{api.baseurl}/txt2img", json=body).status_code == 422
    assert api.session.get(api.baseurl.replace("/sdapi/v1", "/memfit/v1/report/nope")).status_code == 404


def test_img2img_with_several_images_for_qwen_image_edit_plus(tiny_models, memfit_server):
    """webuiapi's img2img(images=[A, B]) sends both as init_images: Qwen-Image-Edit-Plus edits with both, in
    order, as memfit generate's repeated --image (its own scheduler: the flow-matching model has no "Euler a")."""
    import memfit
    from memfit.run.media import png_bytes
    from memfit.testing.conditioning import test_image

    model = tiny_models("qwenimage_edit_plus")
    images = [test_image(64, seed=3), test_image(64, seed=5)]
    expected = memfit.generate("a red circle", model=model, steps=2, seed=4, image=images, progress=False)
    with memfit_server(model) as (_, url):
        host, port = url.rsplit("//", 1)[1].split(":")
        client = webuiapi.WebUIApi(host=host, port=int(port), sampler="Default")
        result = client.img2img(images=images, prompt="a red circle", steps=2, seed=4,
                                cfg_scale=expected.settings.guidance, width=64, height=64)
    assert sent_png(result) == png_bytes(expected.images[0], expected.metadata)
