"""Beyond text to image: img2img, inpaint, ControlNet and LoRA through memfit.generate and the CLI.

Each is held, bitwise at fp32 on CPU, to plain diffusers doing the same: the family's own pipeline
class for the task (e.g. StableDiffusionImg2ImgPipeline.from_pretrained(DIR)), the ControlNet
loaded with ControlNetModel.from_pretrained, LoRAs with load_lora_weights + set_adapters, the same
call arguments and a seeded CPU generator; with and without a budget that streams from disk.
"""

import importlib.util

import pytest

import memfit
from memfit.errors import MemfitError
from conftest import smallest_budget
from memfit.testing import max_pixel_difference
from memfit.testing.conditioning import (
    diffusers_task_image,
    save_controlnet,
    save_controlnet_pipeline,
    save_lora,
    test_image,
    test_mask,
)

PROMPT, NEGATIVE = "a red house near the sea", "blurry"
OURS = dict(negative_prompt=NEGATIVE, steps=2, guidance=4.0, seed=5)
THEIRS = dict(prompt=PROMPT, negative_prompt=NEGATIVE, num_inference_steps=2, guidance_scale=4.0)
PREFIX = {"sd": "StableDiffusion", "sdxl": "StableDiffusionXL"}
needs_peft = pytest.mark.skipif(importlib.util.find_spec("peft") is None,
                                reason="LoRAs need peft (pip install memfit[lora])")


@pytest.fixture(scope="module")
def inputs():
    return {"image": test_image(32, seed=1), "mask": test_mask(32), "control": test_image(32, seed=2)}


@pytest.fixture(scope="module")
def controlnets(tiny_models, tmp_path_factory):
    cache = {}

    def get(kind):
        if kind not in cache:
            cache[kind] = str(save_controlnet(tiny_models(kind), tmp_path_factory.mktemp(f"controlnet-{kind}"), seed=3))
        return cache[kind]

    return get


def _task(kind, task, inputs, controlnets):
    """(memfit.generate keywords, diffusers pipeline class, diffusers call keywords) for a task."""
    image, mask, control = inputs["image"], inputs["mask"], inputs["control"]
    size = dict(height=32, width=32)
    if task == "img2img":
        return dict(image=image, strength=0.7), f"{PREFIX[kind]}Img2ImgPipeline", dict(image=image, strength=0.7)
    if task == "inpaint":
        return (dict(image=image, mask=mask, strength=0.9), f"{PREFIX[kind]}InpaintPipeline",
                dict(image=image, mask_image=mask, strength=0.9, **size))
    if task == "controlnet":
        return (dict(control_image=control, controlnet=controlnets(kind)), f"{PREFIX[kind]}ControlNetPipeline",
                dict(image=control, controlnet=controlnets(kind), **size))
    raise ValueError(task)


def _reference(model, pipeline_class, call, seed=OURS["seed"], loras=()):
    call = dict(call)
    return diffusers_task_image(model, pipeline_class, seed=seed, controlnet=call.pop("controlnet", None), loras=loras,
                                **THEIRS, **call)


TASKS = ["img2img", "inpaint", "controlnet"]


@pytest.mark.slow
@pytest.mark.parametrize("task", TASKS)
@pytest.mark.parametrize("kind", ["sd", "sdxl"])
def test_task_equals_diffusers(tiny_models, inputs, controlnets, kind, task):
    model = tiny_models(kind)
    ours_kwargs, pipeline_class, call = _task(kind, task, inputs, controlnets)
    ours = memfit.generate(PROMPT, model=model, progress=False, **OURS, **ours_kwargs)
    reference = _reference(model, pipeline_class, call)
    assert max_pixel_difference(ours.images[0], reference) == 0
    assert ours.settings.task == task and ours.images[0].size == (32, 32)
    denoise = next(stage for stage in ours.report.stages if stage.stage == "denoise")
    expected = {"img2img": "vae", "inpaint": "vae", "controlnet": "controlnet"}[task]
    assert expected in denoise.components  # the VAE encoder / the ControlNet run in the denoise stage
    # The oracle can fail: the same request without the task's input is another image.
    plain = memfit.generate(PROMPT, model=model, progress=False, width=32, height=32, **OURS)
    assert max_pixel_difference(plain.images[0], reference) > 0


# ---- a budget that streams ----------------------------------------------------------------------


def _smallest_budget(model, **kwargs):
    return smallest_budget(prompt=PROMPT, model=model, **OURS, **kwargs)


def _streamed(plans):
    return {plan.stages[0].name: plan.stages[0].streamed_from_disk_bytes for plan in plans}


@pytest.mark.slow
@pytest.mark.parametrize("task", TASKS)
@pytest.mark.parametrize("kind", ["sd", "sdxl"])
def test_task_under_a_streaming_budget(tiny_models, inputs, controlnets, streamed_plans, kind, task):
    model = tiny_models(kind)
    ours_kwargs, pipeline_class, call = _task(kind, task, inputs, controlnets)
    budget = _smallest_budget(model, **ours_kwargs)
    streamed_plans.clear()
    ours = memfit.generate(PROMPT, model=model, progress=False, budget=budget, **OURS, **ours_kwargs)
    assert max_pixel_difference(ours.images[0], _reference(model, pipeline_class, call)) == 0
    streamed = _streamed(streamed_plans)
    assert set(streamed) == {"encode", "denoise", "decode"} and streamed["denoise"] > 0, streamed
    denoise_plan = next(plan for plan in streamed_plans if plan.stages[0].name == "denoise")
    components = {placement.component for placement in denoise_plan.stages[0].placements}
    # One plan for everything that runs each step: the denoiser with its ControlNet (or the VAE encoder).
    assert components == {"unet", "controlnet" if task == "controlnet" else "vae"}


# ---- a ControlNet pipeline folder ---------------------------------------------------------------


@pytest.mark.slow
def test_controlnet_pipeline_folder(tiny_models, inputs, tmp_path):
    """A folder saved from StableDiffusionControlNetPipeline runs with --control-image alone, and
    memfit encode needs no control image (planning it: the test below)."""
    import diffusers

    model = tiny_models("sd")
    folder = save_controlnet_pipeline(model, tmp_path / "sd-controlnet", seed=3)
    ours = memfit.generate(PROMPT, model=folder, progress=False, control_image=inputs["control"], **OURS)
    pipe = diffusers.DiffusionPipeline.from_pretrained(folder)
    assert type(pipe).__name__ == "StableDiffusionControlNetPipeline"
    reference = _reference(folder, "StableDiffusionControlNetPipeline", dict(image=inputs["control"], height=32, width=32))
    assert max_pixel_difference(ours.images[0], reference) == 0
    with pytest.raises(MemfitError, match="--control-image"):
        memfit.generate(PROMPT, model=folder, progress=False, **OURS)
    # memfit encode needs no control image; generating from its embeddings gives the same image.
    embeddings, _ = memfit.encode(PROMPT, model=folder, negative_prompt=NEGATIVE)
    again = memfit.generate(model=folder, embeddings=embeddings, progress=False, control_image=inputs["control"],
                            **{k: v for k, v in OURS.items() if k != "negative_prompt"})
    assert max_pixel_difference(again.images[0], reference) == 0


def test_plan_model_places_a_controlnet_in_the_denoise_stage(tiny_models, tmp_path, capsys):
    import json

    from memfit.cli import main

    folder = save_controlnet_pipeline(tiny_models("sd"), tmp_path / "sd-controlnet", seed=3)
    assert main(["plan", "--model", str(folder), "--budget", "1GiB", "--width", "32", "--height", "32"]) == 0
    out = capsys.readouterr().out
    assert "not planned" not in out
    assert main(["plan", "--model", str(folder), "--budget", "1GiB", "--width", "32", "--height", "32", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    text = json.dumps(plan)
    assert "controlnet/" in text, text[:500]


# ---- LoRA ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def loras(tiny_models, tmp_path_factory):
    cache = {}

    def get(kind):
        if kind not in cache:
            model = tiny_models(kind)
            root = tmp_path_factory.mktemp(f"lora-{kind}")
            cache[kind] = [(str(save_lora(model, root / "a", seed=1)), 0.7),
                           (str(save_lora(model, root / "b", seed=2, rank=2)), 1.3)]
        return cache[kind]

    return get


@needs_peft
@pytest.mark.slow
@pytest.mark.parametrize("kind", ["sd", "sdxl"])
def test_lora_equals_diffusers(tiny_models, loras, kind):
    model = tiny_models(kind)
    pair = loras(kind)
    ours = memfit.generate(PROMPT, model=model, progress=False, width=32, height=32, **OURS,
                           loras=[f"{pair[0][0]}:{pair[0][1]}", pair[1]])
    call = dict(height=32, width=32)
    reference = _reference(model, f"{PREFIX[kind]}Pipeline", call, loras=pair)
    assert max_pixel_difference(ours.images[0], reference) == 0
    # The oracle can fail: without the LoRAs, or with another scale, the image differs.
    assert max_pixel_difference(_reference(model, f"{PREFIX[kind]}Pipeline", call), reference) > 0
    other = memfit.generate(PROMPT, model=model, progress=False, width=32, height=32, **OURS,
                            loras=[pair[0], (pair[1][0], 0.2)])
    assert max_pixel_difference(other.images[0], reference) > 0


@needs_peft
@pytest.mark.slow
@pytest.mark.parametrize("kind", ["sd", "sdxl"])
def test_lora_with_the_disk_tier(streamed_plans, tmp_path, kind):
    """A budget that streams the text encoders and the UNet from their files, with LoRAs on both:
    the original weights stream from disk, the LoRAs' own tensors stay in memory, and the image is
    plain diffusers' with the LoRAs."""
    from memfit.testing import save_pipeline

    # Deep text encoders, so that the smallest budget streams the encode stage too.
    model = str(save_pipeline(kind, tmp_path / kind, text_layers=24))
    pair = [(str(save_lora(model, tmp_path / "a", seed=1)), 0.7), (str(save_lora(model, tmp_path / "b", seed=2, rank=2)), 1.3)]
    budget = _smallest_budget(model, width=32, height=32, loras=pair)
    streamed_plans.clear()
    ours = memfit.generate(PROMPT, model=model, progress=False, budget=budget, width=32, height=32, **OURS, loras=pair)
    streamed = _streamed(streamed_plans)
    assert streamed["encode"] > 0 and streamed["denoise"] > 0, streamed
    reference = _reference(model, f"{PREFIX[kind]}Pipeline", dict(height=32, width=32), loras=pair)
    assert max_pixel_difference(ours.images[0], reference) == 0


@needs_peft
def test_disk_tier_maps_lora_layers_to_the_file(tiny_models, loras):
    """On a live pipeline with a LoRA, every UNet block on the disk tier: the original weights become
    the file's memory map (base_layer -> the file's key), the LoRA's tensors stay in memory, and the
    output is the unoptimized pipeline's. A fused LoRA is refused, never run as the file's weights."""
    import diffusers
    import torch

    from memfit.run.executor import optimize, restore

    model = tiny_models("sd")
    (file, scale), _ = loras("sd")

    def pipeline():
        pipe = diffusers.DiffusionPipeline.from_pretrained(model)
        pipe.set_progress_bar_config(disable=True)
        pipe.load_lora_weights(file)
        return pipe

    def run(pipe):
        return pipe(PROMPT, num_inference_steps=1, guidance_scale=4.0, height=32, width=32, output_type="np",
                    generator=torch.Generator().manual_seed(0)).images

    pipe = pipeline()
    expected = run(pipe)
    optimize(pipe, force_tiers={"unet": "disk"}, device="cpu")
    mapped = {id(slot.tensor) for slot in vars(pipe)["_memfit_state"].slots if slot.kind == "mmap"}
    named = dict(pipe.unet.named_parameters())
    lora_tensors = [id(t) for name, t in named.items() if ".lora_" in name]
    base_layers = [id(t) for name, t in named.items() if ".base_layer." in name]
    assert lora_tensors and base_layers
    assert not mapped & set(lora_tensors)  # in memory
    assert set(base_layers) <= mapped  # streamed from the model's own file
    assert (run(pipe) == expected).all()
    restore(pipe)

    fused = pipeline()
    fused.fuse_lora(lora_scale=scale)
    with pytest.raises(MemfitError, match="differs from"):
        optimize(fused, force_tiers={"unet": "disk"}, device="cpu")


# ---- refusals -----------------------------------------------------------------------------------


def test_flags_a_family_does_not_take_are_refused(tiny_models, inputs, tmp_path):
    from memfit.cli import main

    flux = tiny_models("flux")
    with pytest.raises(MemfitError, match=r"FluxPipeline does not take --mask yet; supported: .*StableDiffusionPipeline"):
        memfit.generate(PROMPT, model=flux, image=inputs["image"], mask=inputs["mask"], progress=False)
    with pytest.raises(MemfitError, match=r"FluxPipeline does not take --image yet; supported: .*StableDiffusionXLPipeline"):
        memfit.generate(PROMPT, model=flux, image=inputs["image"], progress=False)
    lora = tmp_path / "x.safetensors"
    lora.write_bytes(b"")
    with pytest.raises(MemfitError, match=r"PixArtSigmaPipeline does not take --lora yet; supported: AuraFlowPipeline, "
                                          r"ChromaPipeline, .*FluxPipeline, .*StableDiffusionXLPipeline, .*WanPipeline"):
        memfit.generate(PROMPT, model=tiny_models("pixart_sigma"), loras=[str(lora)], progress=False)
    sd = tiny_models("sd")
    for kwargs, message in [
        (dict(mask=inputs["mask"]), "--mask needs --image"),
        (dict(strength=0.5), "--strength only applies with --image"),
        (dict(control_image=inputs["control"]), "--control-image needs --controlnet"),
        (dict(controlnet=str(tmp_path)), "--controlnet needs --control-image"),
        (dict(image=inputs["image"], strength=1.5), r"--strength must be in \(0, 1\]"),
        (dict(image=inputs["image"], strength=0.4, steps=2), r"runs no denoising step"),
        (dict(image=inputs["image"], width=64), "draws at the size of --image"),
        (dict(image=str(tmp_path / "missing.png")), "--image .*missing.png: no such image file"),
        (dict(loras=[str(tmp_path / "missing.safetensors:0.5")]), "--lora .*missing.safetensors: no such file"),
    ]:
        with pytest.raises(MemfitError, match=message):
            memfit.generate(PROMPT, model=sd, progress=False, **kwargs)
    # Through the CLI: one sentence, exit status 2, no file written.
    out = tmp_path / "out.png"
    assert main(["generate", "--model", flux, "--prompt", PROMPT, "--image", str(tmp_path / "missing.png"),
                 "--out", str(out), "--quiet"]) == 2
    assert not out.exists()


@pytest.mark.slow
def test_cli_img2img_equals_the_api(tiny_models, inputs, tmp_path):
    from PIL import Image

    from memfit.cli import main

    model = tiny_models("sd")
    image_path, mask_path = tmp_path / "in.png", tmp_path / "mask.png"
    inputs["image"].save(image_path)
    inputs["mask"].save(mask_path)
    out = tmp_path / "out.png"
    assert main(["generate", "--model", model, "--prompt", PROMPT, "--negative-prompt", NEGATIVE, "--steps", "2",
                 "--guidance", "4", "--seed", "5", "--image", str(image_path), "--mask", str(mask_path),
                 "--strength", "0.9", "--out", str(out), "--quiet"]) == 0
    reference = _reference(model, "StableDiffusionInpaintPipeline",
                           dict(image=Image.open(image_path).convert("RGB"), mask_image=Image.open(mask_path),
                                strength=0.9, height=32, width=32))
    assert max_pixel_difference(Image.open(out).convert("RGB"), reference) == 0
    assert (Image.open(out).text["task"], Image.open(out).text["strength"]) == ("inpaint", "0.9")


def test_lora_flag_parsing():
    from memfit.models.lora import parse_lora

    assert parse_lora("style.safetensors") == ("style.safetensors", 1.0)
    assert parse_lora("style.safetensors:0.8") == ("style.safetensors", 0.8)
    assert parse_lora("/a/b:c/style.safetensors") == ("/a/b:c/style.safetensors", 1.0)


# ---- memfit.optimize plans what runs together ---------------------------------------------------


def test_optimize_plans_components_that_run_together(tiny_models, inputs, tmp_path):
    """memfit.optimize on a live ControlNet pipeline: one stage per group that runs together (the
    UNet with its ControlNet, the text encoder, the VAE), the denoise group fitted to the budget as a
    whole, and the image unchanged."""
    import diffusers
    import torch

    from memfit.run.executor import optimize, restore

    folder = save_controlnet_pipeline(tiny_models("sd"), tmp_path / "sd-controlnet", seed=3)
    pipe = diffusers.DiffusionPipeline.from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)

    def run():
        return pipe(PROMPT, image=inputs["control"], num_inference_steps=2, guidance_scale=4.0, height=32, width=32,
                    output_type="np", generator=torch.Generator().manual_seed(0)).images

    expected = run()
    together = sum(p.numel() * p.element_size() for m in (pipe.unet, pipe.controlnet) for p in m.parameters())
    budget = int(together * 0.8)  # each alone would fit; together they do not
    assert max(sum(p.numel() * p.element_size() for p in m.parameters()) for m in (pipe.unet, pipe.controlnet)) < budget
    optimize(pipe, budget=budget, device="cpu", activation_bytes=0)  # weights alone: activations are not the point
    stages = {stage.name: stage for stage in pipe._memfit_plan.stages}
    groups = {name: {p.component for p in stage.placements} for name, stage in stages.items()}
    assert groups == {"encode": {"text_encoder"}, "denoise": {"unet", "controlnet"}, "decode": {"vae"}}
    assert stages["denoise"].streamed_from_host_bytes + stages["denoise"].streamed_from_disk_bytes > 0
    assert stages["denoise"].resident_bytes <= budget
    assert (run() == expected).all()
    restore(pipe)


def test_generic_pipelines_plan_a_controlnet_with_the_denoiser():
    """A ControlNet pipeline class without an adapter of its own (Flux's) plans its controlnet in the
    denoise stage, and memfit.optimize groups it with the transformer."""
    from memfit.models.families import adapter_for, run_together

    classes = {name: ("diffusers", "X") for name in ("text_encoder", "tokenizer", "transformer", "controlnet",
                                                     "scheduler", "vae", "image_encoder")}
    adapter = adapter_for("FluxControlNetPipeline", {}, classes)
    assert adapter.stage_components("denoise") == ("transformer", "controlnet", "scheduler")
    assert run_together("FluxControlNetPipeline", ["text_encoder", "transformer", "controlnet", "vae", "image_encoder"]) == [
        ("encode", ["text_encoder"]), ("denoise", ["transformer", "controlnet"]), ("decode", ["vae"]),
        ("image_encoder", ["image_encoder"])]


@needs_peft
@pytest.mark.slow
def test_prompt_cache_knows_the_lora(tiny_models, loras):
    """A LoRA changes the text encoder: the same prompt with another LoRA (or none) is no cache hit,
    the same prompt with the same LoRAs is."""
    model = tiny_models("sd")
    pair = loras("sd")

    def encode_note(**kwargs):
        result = memfit.generate(PROMPT, model=model, progress=False, width=32, height=32, **OURS, **kwargs)
        return result.report.stages[0].note

    assert "cache hit" not in encode_note(loras=pair)
    assert "cache hit" not in encode_note()
    assert "cache hit" not in encode_note(loras=[pair[0], (pair[1][0], 0.2)])
    assert "cache hit" in encode_note(loras=pair)


@needs_peft
@pytest.mark.slow
def test_cli_controlnet_with_loras_equals_diffusers(tiny_models, inputs, controlnets, loras, tmp_path):
    from PIL import Image

    from memfit.cli import main

    model = tiny_models("sd")
    pair = loras("sd")
    control = tmp_path / "control.png"
    inputs["control"].save(control)
    out = tmp_path / "out.png"
    assert main(["generate", "--model", model, "--prompt", PROMPT, "--negative-prompt", NEGATIVE, "--steps", "2",
                 "--guidance", "4", "--seed", "5", "--control-image", str(control), "--controlnet", controlnets("sd"),
                 "--lora", f"{pair[0][0]}:{pair[0][1]}", "--lora", f"{pair[1][0]}:{pair[1][1]}",
                 "--out", str(out), "--quiet"]) == 0
    reference = _reference(model, "StableDiffusionControlNetPipeline",
                           dict(image=Image.open(control).convert("RGB"), controlnet=controlnets("sd"), height=32, width=32),
                           loras=pair)
    assert max_pixel_difference(Image.open(out).convert("RGB"), reference) == 0
