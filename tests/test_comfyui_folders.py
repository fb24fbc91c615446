"""A ComfyUI models folder with no diffusers folder: Wan's and Qwen-Image's VAE files (``wan_2.1_vae.safetensors``,
``qwen_image_vae.safetensors``, Wan 2.1's original keys) as ``--component vae=FILE``; every denoiser alone in
``diffusion_models/`` paired by ``memfit serve --models-dir`` with its VAE from ``vae/`` and its text encoder from
``text_encoders/`` (a --config folder of configs and tokenizers only); SD3's CLIP-L from ComfyUI's ``clip_l.safetensors``,
which holds no projection.

The files are the tiny pipelines' models written in those layouts (memfit.testing.single_file); each image is the
folder's own, bit for bit, and where diffusers loads the file itself (AutoencoderKLWan.from_single_file) diffusers'.
"""

from __future__ import annotations

import base64
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import memfit
from memfit.errors import MemfitError
from memfit.models.folder import ModelFolder
from memfit.models.single_file import SingleFileModel, file_places
from memfit.testing import build_pipeline, max_pixel_difference
from memfit.testing.single_file import save_aligned, wan_vae_original_state_dict

IMAGE = {"prompt": "a red house near the sea", "steps": 2, "seed": 3, "width": 32, "height": 32}
WAN = {**IMAGE, "prompt": "a red circle drifting right", "frames": 5}
SETTINGS = {"wan": WAN, "qwenimage": IMAGE, "chroma": IMAGE, "zimage": IMAGE}


@pytest.fixture(autouse=True)
def no_prompt_cache(monkeypatch):
    """Every run encodes its prompt with the encoder it was given (the prompt cache would hand a run the embedding
    another encoder of the same fingerprint made)."""
    monkeypatch.setenv("MEMFIT_CACHE", "0")


def _frames(result) -> list:
    return list(result.frames) if getattr(result, "frames", None) else list(result.images)


def _vae_file(folder: Path, path: Path) -> Path:
    vae = ModelFolder.open(folder).load_stage(["vae"], torch.float32).vae
    return save_aligned(wan_vae_original_state_dict(vae), path)


def _loaded(folder: Path, name: str, path: Path):
    model = SingleFileModel.with_components(ModelFolder.open(folder), {name: path})
    return getattr(model.load_stage([name], torch.float32, in_file_dtype=[name]), name)


def _assert_views(module, path: Path, materialized: set[str]) -> None:
    places = file_places(module)
    assert places.path == path and places.materialized == materialized, sorted(places.materialized)
    for live, param in module.named_parameters():
        if live not in materialized:
            assert param.data_ptr() == places.view(live)[2].data_ptr(), live


# -- Wan's and Qwen-Image's VAE files --------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["wan", "qwenimage"])
def test_a_wan_layout_vae_file_draws_the_folders_image_from_views(tiny_models, tmp_path, kind):
    """ComfyUI's wan_2.1_vae.safetensors / qwen_image_vae.safetensors (Wan 2.1's original keys), and the same VAE in
    diffusers' names: the folder's video or image, bit for bit, every weight a view of the file."""
    folder = Path(tiny_models(kind))
    settings = SETTINGS[kind]
    expected = _frames(memfit.generate(model=folder, budget="none", progress=False, **settings))
    original = _vae_file(folder, tmp_path / f"{kind}_vae.safetensors")
    own = ModelFolder.open(folder).load_stage(["vae"], torch.float32).vae.state_dict()
    diffusers_names = save_aligned(own, tmp_path / f"{kind}_vae_diffusers.safetensors")
    assert "decoder.middle.0.residual.0.gamma" in SingleFileModel.with_components(
        ModelFolder.open(folder), {"vae": original}).weights["vae"].checkpoint.shapes
    for path, layout in ((original, "Wan"), (diffusers_names, "diffusers")):
        ours = memfit.generate(model=folder, components={"vae": path}, budget="none", progress=False, **settings)
        assert ours.report.notes[0] == f"components from files of their own: vae from {path} ({layout} layout)"
        assert max_pixel_difference(_frames(ours), expected) == 0
        _assert_views(_loaded(folder, "vae", path), path, set())


def test_a_wan_vae_file_converts_as_diffusers_from_single_file_loads_it(tmp_path):
    """A Wan VAE of the released structure (two residual blocks a level, which diffusers' converter's table assumes),
    tiny widths: memfit's conversion names and shapes are diffusers', its tensors the file's own, and the decoded
    video equals diffusers' AutoencoderKLWan.from_single_file's and the model's own, bit for bit."""
    from diffusers import AutoencoderKLWan
    from diffusers.loaders.single_file_utils import convert_wan_vae_to_diffusers

    from memfit.models.weight_layouts import ORIGINAL_WAN_VAE

    torch.manual_seed(0)
    vae = AutoencoderKLWan(base_dim=8, z_dim=4, dim_mult=[1, 2, 4, 4], num_res_blocks=2,
                           temperal_downsample=[False, True, True]).eval()
    stored = wan_vae_original_state_dict(vae)
    assert {"decoder.upsamples.3.resample.1.weight", "decoder.upsamples.4.shortcut.weight",
            "encoder.downsamples.2.resample.1.weight", "conv2.weight"} <= set(stored)
    theirs = convert_wan_vae_to_diffusers(dict(stored))
    ours = ORIGINAL_WAN_VAE.convert(dict(stored), dict(vae.config), vae)
    assert ours.keys() == theirs.keys() == vae.state_dict().keys()
    assert all(ours[key] is theirs[key] for key in ours)  # renames only: the stored tensors themselves

    pipe = build_pipeline("wan")
    pipe.register_modules(vae=vae)
    folder = tmp_path / "wan-released-vae"
    pipe.save_pretrained(folder, safe_serialization=True)
    path = save_aligned(stored, tmp_path / "wan_2.1_vae.safetensors")
    loaded = _loaded(folder, "vae", path)
    _assert_views(loaded, path, set())
    from_single_file = AutoencoderKLWan.from_single_file(str(path), config=str(folder), subfolder="vae",
                                                        torch_dtype=torch.float32, local_files_only=True).eval()
    latents = torch.randn(1, 4, 2, 4, 4, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        outputs = [model.decode(latents).sample for model in (loaded, from_single_file, vae)]
    assert torch.equal(outputs[0], outputs[1]) and torch.equal(outputs[0], outputs[2])


def test_a_wan22_vae_file_draws_the_5bs_video_from_views(tiny_models, tmp_path):
    """ComfyUI's wan2.2_vae.safetensors (the TI2V-5B's VAE in Wan 2.2's original keys: each level a block of its own,
    which diffusers' single-file converter does not know): read by renames, the folder's video bit for bit, every
    weight a view of the file; a Wan 2.1 model refuses it naming the shapes."""
    from memfit.testing.single_file import wan22_vae_original_state_dict

    folder = Path(tiny_models("wan22_ti2v"))
    settings = dict(WAN, width=64, height=64)  # the 5B's VAE shrinks 16x
    vae = ModelFolder.open(folder).load_stage(["vae"], torch.float32).vae
    stored = wan22_vae_original_state_dict(vae)
    assert {"encoder.downsamples.0.downsamples.1.resample.1.weight", "decoder.upsamples.0.upsamples.2.time_conv.weight",
            "decoder.upsamples.0.upsamples.1.residual.6.weight", "decoder.middle.2.residual.0.gamma"} <= set(stored)
    path = save_aligned(stored, tmp_path / "wan2.2_vae.safetensors", like=next((folder / "vae").glob("*.safetensors")))
    expected = _frames(memfit.generate(model=folder, budget="none", progress=False, **settings))
    ours = memfit.generate(model=folder, components={"vae": path}, budget="none", progress=False, **settings)
    assert ours.report.notes[0] == f"components from files of their own: vae from {path} (Wan 2.2 layout)"
    assert max_pixel_difference(_frames(ours), expected) == 0
    _assert_views(_loaded(folder, "vae", path), path, set())
    with pytest.raises(MemfitError, match=r"--component vae=.*wan2.2_vae.safetensors does not fit"):
        SingleFileModel.with_components(ModelFolder.open(tiny_models("wan")), {"vae": path})
    # In a ComfyUI folder beside Wan 2.1's VAE, the 5B's transformer alone is paired with this one.
    from memfit.models.library import ModelsDir, config_folders
    from memfit.testing.single_file import wan_original_state_dict

    models = tmp_path / "models"
    for sub in ("diffusion_models", "vae", "text_encoders"):
        (models / sub).mkdir(parents=True)
    pipe = ModelFolder.open(folder).load_stage(["transformer", "text_encoder"], torch.float32)
    save_aligned(wan_original_state_dict(pipe.transformer), models / "diffusion_models" / "wan2.2_ti2v_5B_fp16.safetensors")
    save_aligned(pipe.text_encoder.state_dict(), models / "text_encoders" / "umt5_xxl_fp16.safetensors")
    (models / "vae" / path.name).symlink_to(path)
    _vae_file(Path(tiny_models("wan")), models / "vae" / "wan_2.1_vae.safetensors")
    configs = tmp_path / "configs"
    shutil.copytree(folder, configs, ignore=shutil.ignore_patterns("*.safetensors"))
    entry = ModelsDir(models, configs=config_folders([configs])).scan().checkpoints[0]
    assert entry.error == "" and dict(entry.candidates)["vae"] == (models / "vae" / path.name,), entry.error


# -- SD3's CLIP-L from ComfyUI's clip_l.safetensors ---------------------------------------------------------------

def test_sd3s_clip_l_file_without_projection_runs_as_the_identity(tiny_models, tmp_path):
    """ComfyUI's clip_l.safetensors holds no text_projection; SD3 runs its CLIP-L with the identity there (the tiny
    folder's is the identity): the folder's image, every weight but that one a view of the file."""
    from memfit.testing.single_file import sd3_states

    folder = Path(tiny_models("sd3_single_file"))
    states = sd3_states(folder)
    assert "text_projection.weight" not in states["text_encoder"]
    path = save_aligned(states["text_encoder"], tmp_path / "clip_l.safetensors")
    expected = _frames(memfit.generate(model=folder, budget="none", progress=False, **IMAGE))
    ours = memfit.generate(model=folder, components={"text_encoder": path}, budget="none", progress=False, **IMAGE)
    assert max_pixel_difference(_frames(ours), expected) == 0
    encoder = _loaded(folder, "text_encoder", path)
    _assert_views(encoder, path, {"text_projection.weight"})
    assert torch.equal(encoder.text_projection.weight, torch.eye(encoder.config.hidden_size))
    # The SD3.5 transformer alone, every other model from a file of its own: the folder's image too.
    configs_only = tmp_path / "configs"
    shutil.copytree(folder, configs_only, ignore=shutil.ignore_patterns("*.safetensors"))
    files = {name: save_aligned(states[name], tmp_path / f"{name}.safetensors")
             for name in ("transformer", "vae", "text_encoder_2", "text_encoder_3")}
    ours = memfit.generate(model=files.pop("transformer"), config=configs_only, components={**files, "text_encoder": path},
                           budget="none", progress=False, **IMAGE)
    assert max_pixel_difference(_frames(ours), expected) == 0


@pytest.mark.parametrize("kind, name", [("sd3_single_file", "text_encoder_2"), ("sdxl", "text_encoder_2")])
def test_another_clip_without_its_projection_is_refused(tiny_models, tmp_path, kind, name):
    """Only SD3's CLIP-L runs with the identity: SD3's CLIP-G or SDXL's bigG without its projection is refused."""
    from memfit.testing.single_file import _clip_state

    encoder = ModelFolder.open(tiny_models(kind)).load_stage([name], torch.float32)
    path = tmp_path / "clip_g.safetensors"
    save_file({k: v.contiguous() for k, v in _clip_state(getattr(encoder, name), projection=False).items()}, path)
    with pytest.raises(MemfitError, match=f"has no tensor 'text_projection.weight', which {name} "
                                          r"\(CLIPTextModelWithProjection\) needs"):
        SingleFileModel.with_components(ModelFolder.open(tiny_models(kind)), {name: path})


# -- A ComfyUI models folder: denoisers alone paired by family ------------------------------------------------------

def _encoder_state(folder: Path) -> dict[str, torch.Tensor]:
    pipe = ModelFolder.open(folder).load_stage(["text_encoder"], torch.float32)
    return {key: value.detach() for key, value in pipe.text_encoder.state_dict().items()}


def _comfy_files(folder: Path, kind: str) -> dict[str, tuple[str, dict]]:
    """component -> (ComfyUI's file name, its tensors) for the tiny ``kind`` folder."""
    import diffusers

    from memfit.testing.single_file import (
        chroma_original_state_dict,
        ldm_vae_state_dict,
        wan_original_state_dict,
        z_image_original_state_dict,
    )

    pipe = diffusers.DiffusionPipeline.from_pretrained(folder)
    text = _encoder_state(folder)
    if kind == "wan":
        return {"transformer": ("wan2.1_t2v_1.3B_fp16.safetensors", wan_original_state_dict(pipe.transformer)),
                "vae": ("wan_2.1_vae.safetensors", wan_vae_original_state_dict(pipe.vae)),
                "text_encoder": ("umt5_xxl_fp16.safetensors",
                                 {k: v for k, v in text.items() if k != "encoder.embed_tokens.weight"})}
    if kind == "qwenimage":
        comfy = {("model." + k.removeprefix("model.language_model.") if k.startswith("model.language_model.")
                  else k.removeprefix("model.") if k.startswith("model.visual.") else k): v for k, v in text.items()}
        return {"transformer": ("qwen_image_bf16.safetensors", pipe.transformer.state_dict()),
                "vae": ("qwen_image_vae.safetensors", wan_vae_original_state_dict(pipe.vae)),
                "text_encoder": ("qwen_2.5_vl_7b.safetensors", comfy)}
    if kind == "chroma":
        return {"transformer": ("chroma-unlocked-v48.safetensors", chroma_original_state_dict(pipe.transformer)),
                "vae": ("ae.safetensors", ldm_vae_state_dict(pipe.vae)),
                "text_encoder": ("t5xxl_fp16.safetensors",
                                 {k: v for k, v in text.items() if k != "encoder.embed_tokens.weight"})}
    return {"transformer": ("z_image_turbo_bf16.safetensors", z_image_original_state_dict(pipe.transformer)),
            "vae": ("ae.safetensors", ldm_vae_state_dict(pipe.vae)),
            "text_encoder": ("qwen_3_4b.safetensors", {"model." + k: v for k, v in text.items()})}


@pytest.fixture(scope="module")
def comfyui(tiny_models, tmp_path_factory):
    """(ComfyUI root, {kind: its diffusers folder}, {kind: configs-only folder}, {kind: {component: file}}): the four
    families' denoisers in diffusion_models/, their VAEs in vae/, their text encoders in text_encoders/, all in one
    folder. Chroma and Z-Image share Flux's ae.safetensors, as ComfyUI keeps them: the Z-Image folder here is the tiny
    one with Chroma's VAE weights (one architecture)."""
    root = tmp_path_factory.mktemp("comfyui")
    models = root / "ComfyUI" / "models"
    for sub in ("diffusion_models", "vae", "text_encoders"):
        (models / sub).mkdir(parents=True)
    folders = {kind: Path(tiny_models(kind)) for kind in ("wan", "qwenimage", "chroma")}
    folders["zimage"] = Path(shutil.copytree(tiny_models("zimage"), root / "zimage-with-ae"))
    shutil.copy(folders["chroma"] / "vae" / "diffusion_pytorch_model.safetensors",
                folders["zimage"] / "vae" / "diffusion_pytorch_model.safetensors")
    configs, files = {}, {}
    for kind, folder in folders.items():
        configs[kind] = root / f"{kind}-configs"
        shutil.copytree(folder, configs[kind], ignore=shutil.ignore_patterns("*.safetensors"))
        files[kind] = {}
        for name, (file_name, state) in _comfy_files(folder, kind).items():
            sub = {"transformer": "diffusion_models", "vae": "vae", "text_encoder": "text_encoders"}[name]
            files[kind][name] = save_aligned(state, models / sub / file_name)
    return root / "ComfyUI", folders, configs, files


def test_each_denoiser_alone_is_paired_with_its_familys_files(comfyui):
    """Every candidate file is tried against every missing model; only the family's own fits (a Qwen3 file is not
    taken for a UMT5 or T5 slot, Qwen-Image's VAE not for Wan's: the files' widths and names tell them apart), and
    each entry opens with no weights in its config folder."""
    from memfit.models.library import ModelsDir, config_folders, open_entry

    root, _, configs, files = comfyui
    library = ModelsDir(root, configs=config_folders(configs.values()))
    entries = {entry.path: entry for entry in library.scan().checkpoints}
    assert all(entry.kind == "split" for entry in entries.values())
    for kind, made in files.items():
        entry = entries[made["transformer"]]
        assert entry.error == "" and entry.pipeline, (kind, entry.error)
        assert dict(entry.components) == {"vae": made["vae"], "text_encoder": made["text_encoder"]}, kind
        assert dict(entry.candidates) == {"vae": (made["vae"],), "text_encoder": (made["text_encoder"],)}, kind
        model = open_entry(entry, configs=library.configs)
        assert model.weight_files("vae") == [made["vae"]] and model.weight_files("text_encoder") == [made["text_encoder"]]


def test_a_wan_vae_named_for_the_family_is_taken_before_qwen_images(comfyui, tmp_path):
    """Wan 2.1's VAE and Qwen-Image's have one architecture (the real ones fit each other's slots): of two files that
    fit, the one whose name says the family is taken."""
    from memfit.models.library import ModelsDir, config_folders

    root, _, configs, files = comfyui
    models = tmp_path / "models"
    for sub in ("diffusion_models", "vae", "text_encoders"):
        (models / sub).mkdir(parents=True)
    made = files["wan"]
    (models / "diffusion_models" / made["transformer"].name).symlink_to(made["transformer"])
    (models / "text_encoders" / made["text_encoder"].name).symlink_to(made["text_encoder"])
    for name in ("a_qwen_image_vae.safetensors", "wan_2.1_vae.safetensors"):  # both Wan's: Qwen-Image's name first
        (models / "vae" / name).symlink_to(made["vae"])
    entry = ModelsDir(models, configs=config_folders([configs["wan"]])).scan().checkpoints[0]
    assert entry.error == "" and dict(entry.components)["vae"].name == "wan_2.1_vae.safetensors"
    (models / "text_encoders" / made["text_encoder"].name).unlink()
    (models / "text_encoders" / "qwen_3_4b.safetensors").symlink_to(files["zimage"]["text_encoder"])
    lacking = ModelsDir(models, configs=config_folders([configs["wan"]])).scan().checkpoints[0]
    assert "no file of the models folder fits its text_encoder (UMT5EncoderModel, e.g. umt5_xxl_fp16.safetensors) in " \
           "text_encoders/" in lacking.error


@pytest.mark.parametrize("kind", ["wan", "qwenimage", "chroma", "zimage"])
def test_no_other_familys_text_encoder_is_taken(comfyui, tmp_path, kind):
    """With every other family's text encoder in text_encoders/ and not its own, nothing is paired for it: UMT5,
    T5, Qwen2.5-VL and Qwen3 files of one width are each refused by the others' slots (their tensors differ)."""
    from memfit.models.library import ModelsDir, config_folders

    _, _, configs, files = comfyui
    models = tmp_path / "models"
    for sub in ("diffusion_models", "vae", "text_encoders"):
        (models / sub).mkdir(parents=True)
    (models / "diffusion_models" / files[kind]["transformer"].name).symlink_to(files[kind]["transformer"])
    (models / "vae" / files[kind]["vae"].name).symlink_to(files[kind]["vae"])
    others = [made["text_encoder"] for other, made in files.items() if other != kind]
    for path in others:
        (models / "text_encoders" / path.name).symlink_to(path)
    entry = ModelsDir(models, configs=config_folders([configs[kind]])).scan().checkpoints[0]
    assert "no file of the models folder fits its text_encoder (" in entry.error and not entry.pipeline, entry.error
    assert "vae" not in entry.error.split("fits its", 1)[1]


@pytest.fixture(scope="module")
def served(comfyui, memfit_server):
    pytest.importorskip("fastapi", reason="memfit serve needs FastAPI: pip install 'memfit[serve]'")
    pytest.importorskip("uvicorn", reason="memfit serve needs uvicorn: pip install 'memfit[serve]'")
    root, _, configs, _ = comfyui
    flags = [flag for folder in configs.values() for flag in ("--config", str(folder))]
    with memfit_server(None, "--models-dir", str(root), *flags) as (_, url):
        yield url


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["wan", "zimage", "chroma", "qwenimage"])
def test_a_comfyui_folder_is_served_as_memfit_generate_makes_it(served, comfyui, kind):
    """memfit serve --models-dir over the folder: each denoiser is listed with no error, and a txt2img request with it
    selected gives the image `memfit generate --model FILE --config DIR --component ...` makes from the same files,
    which is the diffusers folder's own."""
    httpx = pytest.importorskip("httpx", reason="the server is polled with httpx: pip install 'memfit[serve]'")
    from memfit.run.media import png_bytes

    _, folders, configs, files = comfyui
    made = files[kind]
    listed = {c["name"]: c for c in httpx.get(served + "/memfit/v1/models", timeout=60).json()["checkpoints"]}
    name = f"diffusion_models/{made['transformer'].name}"
    assert not listed[name]["error"] and listed[name]["kind"] == "split", listed[name]
    body = {"prompt": IMAGE["prompt"], "negative_prompt": "blurry", "steps": 2, "cfg_scale": 3.5, "width": 32,
            "height": 32, "seed": 3, "sampler_name": "Euler", "override_settings": {"sd_model_checkpoint": name}}
    answer = httpx.post(served + "/sdapi/v1/txt2img", json=body, timeout=600)
    assert answer.status_code == 200, answer.text
    settings = dict(negative_prompt="blurry", steps=2, guidance=3.5, width=32, height=32, seed=3, sampler="Euler",
                    progress=False, **({"frames": 1} if kind == "wan" else {}))  # txt2img asks Wan for one frame
    result = memfit.generate(body["prompt"], model=made["transformer"], config=configs[kind],
                             components={"vae": made["vae"], "text_encoder": made["text_encoder"]}, **settings)
    assert base64.b64decode(answer.json()["images"][0]) == png_bytes(_frames(result)[0], result.metadata)
    folder = memfit.generate(body["prompt"], model=folders[kind], **settings)
    assert max_pixel_difference(_frames(result), _frames(folder)) == 0
