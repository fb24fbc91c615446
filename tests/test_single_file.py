"""All-in-one single-file checkpoints (A1111's and ComfyUI's): memfit opens them as it opens folders.

The file is the tiny SD pipeline written in the LDM key layout (memfit.testing.single_file, the
inverse of diffusers' conversion). Its images equal diffusers' own from_single_file and the same
model as a folder, bit for bit, with no budget and with one that streams from the file.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

import memfit
from memfit.errors import MemfitError
from memfit.models.single_file import SingleFileModel, file_places
from memfit.testing.single_file import save_single_file

SETTINGS = dict(prompt="a red house near the sea", negative_prompt="blurry", steps=2, seed=3, width=32, height=32)


@pytest.fixture(scope="module")
def checkpoint(tiny_models, tmp_path_factory):
    """(the tiny SD folder, the same model as one LDM .safetensors file)."""
    folder = Path(tiny_models("sd"))
    return folder, save_single_file(folder, tmp_path_factory.mktemp("single-file") / "tiny-sd.safetensors")


@pytest.fixture(scope="module")
def xl_checkpoint(tmp_path_factory):
    """(a tiny SDXL folder, the same model as one LDM .safetensors file: OpenCLIP layout for its bigG encoder)."""
    from memfit.testing import save_pipeline

    root = tmp_path_factory.mktemp("single-file-xl")
    folder = save_pipeline("sdxl_single_file", root / "sdxl")
    return folder, save_single_file(folder, root / "tiny-sdxl.safetensors")


@pytest.fixture(scope="module")
def folder_image(checkpoint):
    """The image memfit draws with SETTINGS from the same model as a folder."""
    return _pixels(memfit.generate(model=checkpoint[0], budget="none", progress=False, **SETTINGS))


def _pixels(result):
    return np.asarray(result.images[0], dtype=np.int16)


def _diffusers_single_file_image(path, config, pipeline_class="StableDiffusionPipeline"):
    """What diffusers' own single-file loading draws with SETTINGS (CPU, fp32)."""
    import diffusers

    pipe = getattr(diffusers, pipeline_class).from_single_file(str(path), config=str(config), local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    generator = torch.Generator(device="cpu").manual_seed(SETTINGS["seed"])
    image = pipe(prompt=SETTINGS["prompt"], negative_prompt=SETTINGS["negative_prompt"], width=32, height=32,
                 num_inference_steps=SETTINGS["steps"], generator=generator).images[0]
    return np.asarray(image, dtype=np.int16)


def test_equals_diffusers_single_file_and_the_folder(checkpoint, folder_image):
    folder, path = checkpoint
    ours = memfit.generate(model=path, config=folder, budget="none", progress=False, **SETTINGS)
    assert np.array_equal(_pixels(ours), _diffusers_single_file_image(path, folder))
    assert np.array_equal(_pixels(ours), folder_image)
    assert ours.metadata["model"] == str(path)
    assert ours.report.notes[0].endswith(f"configs and tokenizers from --config {folder}")


def test_a_budget_streams_from_the_file_and_keeps_the_image(checkpoint, folder_image, streamed_plans):
    from conftest import smallest_budget

    folder, path = checkpoint
    budget = smallest_budget(model=path, config=folder, **dict(SETTINGS, steps=1))
    assert budget < (folder / "unet" / "diffusion_pytorch_model.safetensors").stat().st_size
    streamed_plans.clear()
    ours = memfit.generate(model=path, config=folder, budget=budget, progress=False, **SETTINGS)
    streamed = {plan.stages[0].name: plan.stages[0].streamed_from_disk_bytes for plan in streamed_plans}
    assert set(streamed) == {"encode", "denoise", "decode"} and streamed["denoise"] > 0, streamed
    assert np.array_equal(_pixels(ours), folder_image)


def test_a_half_precision_file_streams_converted_block_by_block(tmp_path, streamed_plans):
    """Published files are fp16: run at fp32 under a budget, each weight is read from the file and converted
    block by block (loaded in the file's dtype), as a folder's are; the image is the folder's."""
    from memfit.testing import save_pipeline

    folder = save_pipeline("sd", tmp_path / "sd-fp16", dtype=torch.float16)
    path = save_single_file(folder, tmp_path / "sd-fp16.safetensors")
    ours = memfit.generate(model=path, config=folder, budget=400_000, progress=False, **SETTINGS)
    assert {plan.stages[0].name: plan.stages[0].streamed_from_disk_bytes for plan in streamed_plans}["denoise"] > 0
    assert np.array_equal(_pixels(ours), _pixels(memfit.generate(model=folder, budget="none", progress=False,
                                                                  **SETTINGS)))


def test_encode_then_a_session_on_the_file(checkpoint, folder_image):
    """memfit encode and a Session take the file as memfit.generate does; embeddings made from it fit it."""
    from memfit.run.session import Session

    folder, path = checkpoint
    embeddings, report = memfit.encode(SETTINGS["prompt"], model=path, config=folder,
                                       negative_prompt=SETTINGS["negative_prompt"], budget="none")
    assert report.notes[0].startswith("model: tiny-sd.safetensors, a Stable Diffusion 1.x single-file checkpoint")
    session = Session(path, config=folder, budget="none")
    settings = {key: value for key, value in SETTINGS.items() if key not in ("prompt", "negative_prompt")}
    assert np.array_equal(_pixels(session.generate(None, embeddings=embeddings, **settings)), folder_image)


def test_sdxl_equals_diffusers_single_file_and_the_folder(xl_checkpoint):
    folder, path = xl_checkpoint
    ours = memfit.generate(model=path, config=folder, budget="none", progress=False, **SETTINGS)
    assert ours.report.notes[0].startswith("model: tiny-sdxl.safetensors, a Stable Diffusion XL single-file checkpoint")
    assert np.array_equal(_pixels(ours), _diffusers_single_file_image(path, folder, "StableDiffusionXLPipeline"))
    assert np.array_equal(_pixels(ours), _pixels(memfit.generate(model=folder, budget="none", progress=False,
                                                                  **SETTINGS)))


def test_sdxl_streams_from_the_file_keeping_the_projection_it_computed(xl_checkpoint, streamed_plans):
    """The bigG encoder's q, k and v are row slices of its fused in_proj (views that stream); its projection
    is stored transposed, so it alone is computed, kept in memory and counted as resident."""
    from conftest import smallest_budget, with_staging_ring

    from memfit.run.executor import live_blocks

    folder, path = xl_checkpoint
    model = SingleFileModel.open_file(path, config=folder)
    encoder = model.load_stage(["text_encoder_2"], torch.float32, in_file_dtype=["text_encoder_2"]).text_encoder_2
    places = file_places(encoder)
    assert places.materialized == {"text_projection.weight"}
    assert places.places["text_model.encoder.layers.9.self_attn.k_proj.weight"].key == \
        "conditioner.embedders.1.model.transformer.resblocks.9.attn.in_proj_weight"
    budget = smallest_budget(model=path, config=folder, **dict(SETTINGS, steps=1))
    streamed_plans.clear()
    ours = memfit.generate(model=path, config=folder, budget=budget, progress=False, **SETTINGS)
    encode = next(plan.stages[0] for plan in streamed_plans if plan.stages[0].name == "encode")
    assert encode.streamed_from_disk_bytes > 0
    # Planned like the component's first weight: resident whatever its block's tier.
    fixed = sum(block.fixed_bytes for block in live_blocks("text_encoder_2", encoder))
    assert fixed == (next(encoder.parameters()).numel() + encoder.text_projection.weight.numel()) * 4
    expected = _pixels(memfit.generate(model=folder, budget="none", progress=False, **SETTINGS))
    assert np.array_equal(_pixels(ours), expected)
    # On a GPU (the lazy fake CUDA runtime: a missing wait changes the image) the computed tensor goes to the
    # device with the first weight, the rest streams from the file through the pinned staging ring.
    from memfit.testing.fake_cuda import fake_cuda

    with fake_cuda(lazy=True) as gpu:
        on_gpu = with_staging_ring(lambda gpu_budget: memfit.generate(
            model=path, config=folder, device="cuda", progress=False, budget=gpu_budget, **SETTINGS), budget, path)
        assert gpu.copies > 0
    assert np.array_equal(_pixels(on_gpu), expected)


def test_loaded_weights_are_views_of_the_file(checkpoint):
    """No converted state dict is built: every weight loaded in the file's dtype is the file's own bytes."""
    folder, path = checkpoint
    model = SingleFileModel.open_file(path, config=folder)
    pipe = model.load_stage(["unet", "vae", "text_encoder"], torch.float32, in_file_dtype=["unet", "vae", "text_encoder"])
    for name in ("unet", "vae", "text_encoder"):
        module = getattr(pipe, name)
        places = file_places(module)
        assert not places.materialized
        for live, param in module.named_parameters():
            _, key, view = places.view(live)
            assert param.data_ptr() == view.data_ptr() and param.shape == view.shape, (name, live, key)
    # The VAE's attention projections are 1x1 convolutions in the file: read as linear weights, a view.
    assert file_places(pipe.vae).places["decoder.mid_block.attentions.0.to_q.weight"].key == \
        "first_stage_model.decoder.mid.attn_1.q.weight"


def test_fingerprints_follow_each_components_tensors(checkpoint, tmp_path):
    """Cache keys by content: a change to the UNet's bytes changes the UNet's fingerprint, not the text's."""
    from memfit.safetensors_header import read_header

    folder, path = checkpoint
    changed = tmp_path / "changed.safetensors"
    shutil.copy(path, changed)
    header = read_header(changed)
    begin, _ = header.entries["model.diffusion_model.out.2.weight"]["data_offsets"]
    with changed.open("r+b") as handle:
        handle.seek(header.data_start + begin)
        handle.write(b"\x01\x02\x03\x04")
    first, second = (SingleFileModel.open_file(p, config=folder) for p in (path, changed))
    assert first.text_fingerprint == second.text_fingerprint
    assert first.component_fingerprint("unet") != second.component_fingerprint("unet")
    assert first.component_fingerprint("vae") == second.component_fingerprint("vae")


def test_plan_sizes_the_file_from_its_header_as_the_folder(checkpoint, capsys):
    from memfit.cli.app import main

    folder, path = checkpoint
    plans = []
    for model in ([str(path), "--config", str(folder)], [str(folder)]):
        assert main(["plan", "--model", *model, "--budget", "70MiB", "--process-memory", "0", "--json"]) == 0
        plans.append(json.loads(capsys.readouterr().out)["plan"])
    assert [plan["budget"].pop("disk") for plan in plans] == [str(path), str(folder)]  # each streams from its own
    assert plans[0] == plans[1]


def test_configs_from_the_hugging_face_cache(checkpoint, folder_image, tmp_path, monkeypatch):
    """No --config: the family's default repository in the Hugging Face cache, configs only (no weights)."""
    from memfit.models.single_file import FAMILIES
    from memfit.models.single_file_configs import default_repository

    folder, path = checkpoint
    repository = default_repository(FAMILIES["v1"])
    cache = tmp_path / "hf" / "hub" / f"models--{repository.replace('/', '--')}"
    snapshot = cache / "snapshots" / "0123456789abcdef0123456789abcdef01234567"
    shutil.copytree(folder, snapshot, ignore=shutil.ignore_patterns("*.safetensors"))
    (cache / "refs").mkdir()
    (cache / "refs" / "main").write_text(snapshot.name)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    ours = memfit.generate(model=path, budget="none", progress=False, **SETTINGS)
    assert ours.report.notes[0].endswith(f"configs and tokenizers from the Hugging Face cache's snapshot of "
                                         f"{repository} ({snapshot})")
    assert np.array_equal(_pixels(ours), folder_image)


def test_a_pickle_checkpoint_loads_only_with_allow_pickle(checkpoint, folder_image, tmp_path):
    from safetensors.torch import load_file

    folder, path = checkpoint
    ckpt = tmp_path / "tiny-sd.ckpt"
    torch.save({"state_dict": load_file(path), "global_step": 1}, ckpt)
    with pytest.raises(MemfitError, match="is a pickle checkpoint"):
        memfit.generate(model=ckpt, config=folder, budget="none", progress=False, **SETTINGS)
    ours = memfit.generate(model=ckpt, config=folder, budget="none", progress=False, allow_pickle=True, **SETTINGS)
    assert np.array_equal(_pixels(ours), folder_image)


# -- one component from a file of its own (--component NAME=FILE) ---------------------------------

@pytest.fixture(scope="module")
def other_vae(tmp_path_factory):
    """(another tiny SD's VAE folder, that VAE as an LDM-key file as A1111's models/VAE hold it)."""
    from diffusers import AutoencoderKL
    from safetensors.torch import save_file

    from memfit.testing import save_pipeline
    from memfit.testing.single_file import ldm_vae_state_dict

    root = tmp_path_factory.mktemp("other-vae")
    folder = save_pipeline("sd", root / "sd-seed-1", seed=1) / "vae"
    path = root / "vae-ldm.safetensors"
    save_file({key: value.contiguous() for key, value in ldm_vae_state_dict(AutoencoderKL.from_pretrained(folder)).items()},
              path)
    return folder, path


def _diffusers_image(pipe):
    pipe.set_progress_bar_config(disable=True)
    generator = torch.Generator(device="cpu").manual_seed(SETTINGS["seed"])
    image = pipe(prompt=SETTINGS["prompt"], negative_prompt=SETTINGS["negative_prompt"], width=32, height=32,
                 num_inference_steps=SETTINGS["steps"], generator=generator).images[0]
    return np.asarray(image, dtype=np.int16)


@pytest.fixture(scope="module")
def other_vae_image(checkpoint, other_vae):
    """What plain diffusers draws with the tiny SD folder and the other VAE, read from its LDM file by diffusers."""
    import diffusers

    vae = diffusers.AutoencoderKL.from_single_file(str(other_vae[1]), config=str(checkpoint[0]), subfolder="vae",
                                                   local_files_only=True)
    return _diffusers_image(diffusers.StableDiffusionPipeline.from_pretrained(checkpoint[0], vae=vae))


@pytest.mark.parametrize("layout", ["LDM", "diffusers"])
def test_a_vae_file_replaces_the_folders_vae(checkpoint, other_vae, other_vae_image, folder_image, layout):
    folder, _ = checkpoint
    vae = other_vae[1] if layout == "LDM" else other_vae[0] / "diffusion_pytorch_model.safetensors"
    ours = memfit.generate(model=folder, components={"vae": vae}, budget="none", progress=False, **SETTINGS)
    assert np.array_equal(_pixels(ours), other_vae_image)
    assert not np.array_equal(other_vae_image, folder_image)  # the file's VAE, not the folder's
    assert ours.report.notes[0] == f"components from files of their own: vae from {vae} ({layout} layout)"


def test_a_vae_file_streams_under_a_budget(checkpoint, other_vae, other_vae_image, streamed_plans):
    from conftest import smallest_budget

    from memfit.run.session import Session

    folder, _ = checkpoint
    components = {"vae": other_vae[1]}
    budget = smallest_budget(model=folder, components=components, **dict(SETTINGS, steps=1))
    streamed_plans.clear()
    session = Session(folder, components=components, budget=budget, warm=False)
    ours = session.generate(SETTINGS["prompt"], **{k: v for k, v in SETTINGS.items() if k != "prompt"})
    streamed = {plan.stages[0].name: plan.stages[0].streamed_from_disk_bytes for plan in streamed_plans}
    assert streamed["decode"] > 0, streamed
    assert np.array_equal(_pixels(ours), other_vae_image)
    vae = session.folder.load_stage(["vae"], torch.float32).vae
    assert file_places(vae).path == other_vae[1] and not file_places(vae).materialized


def test_a_checkpoints_vae_and_a_folders_bigg_encoder_from_files(checkpoint, other_vae, other_vae_image,
                                                                 xl_checkpoint, capsys):
    """An all-in-one checkpoint takes a VAE file as a folder does; a text encoder is found inside an SDXL
    checkpoint given as its file (OpenCLIP layout, under its prefix there), which memfit tells from the
    CLIP-L beside it by which one fits the component's config."""
    from memfit.cli.app import main
    from memfit.models.folder import ModelFolder

    folder, path = checkpoint
    ours = memfit.generate(model=path, config=folder, components={"vae": other_vae[1]}, budget="none", progress=False,
                           **SETTINGS)
    assert np.array_equal(_pixels(ours), other_vae_image)
    xl_folder, xl_path = xl_checkpoint
    model = SingleFileModel.with_components(ModelFolder.open(xl_folder), {"text_encoder_2": xl_path})
    weights = model.weights["text_encoder_2"]
    assert (weights.layout.name, weights.prefix) == ("OpenCLIP", "conditioner.embedders.1.model.")
    loaded = model.load_stage(["text_encoder_2"], torch.float32).text_encoder_2.state_dict()
    expected = ModelFolder.open(xl_folder).load_stage(["text_encoder_2"], torch.float32).text_encoder_2.state_dict()
    assert loaded.keys() == expected.keys() and all(torch.equal(loaded[key], expected[key]) for key in expected)
    assert model.component_fingerprint("text_encoder_2") != model.component_fingerprint("text_encoder")
    plans = []
    for extra in (["--component", f"vae={other_vae[1]}"], []):
        assert main(["plan", "--model", str(folder), *extra, "--budget", "70MiB", "--process-memory", "0", "--json"]) == 0
        plans.append(json.loads(capsys.readouterr().out)["plan"])
    assert plans[0] == plans[1]


# -- SD 2.x and the SDXL refiner --------------------------------------------------------------------

def test_sd2_equals_diffusers_single_file(tmp_path):
    """SD 2's OpenCLIP encoder: the file's extra layer and unused projection are left out, as diffusers leaves them."""
    from memfit.testing import save_pipeline

    folder = save_pipeline("sd2_single_file", tmp_path / "sd2", text_layers=1)
    path = save_single_file(folder, tmp_path / "tiny-sd2.safetensors")
    ours = memfit.generate(model=path, config=folder, budget="none", progress=False, **SETTINGS)
    assert ours.report.notes[0].startswith("model: tiny-sd2.safetensors, a Stable Diffusion 2.x single-file checkpoint")
    assert np.array_equal(_pixels(ours), _diffusers_single_file_image(path, folder))


def test_an_sdxl_refiner_file_with_its_own_configs(tmp_path):
    """--refiner FILE --refiner-config DIR: the refiner's bigG alone, at conditioner.embedders.0.model."""
    from memfit.testing.refiner import diffusers_refined_image, save_base_and_refiner

    base, refiner = save_base_and_refiner(tmp_path / "base", tmp_path / "refiner", kind="sdxl_single_file")
    path = save_single_file(refiner, tmp_path / "tiny-refiner.safetensors")
    settings = dict(SETTINGS, guidance=5.0)
    ours = memfit.generate(model=base, refiner=path, refiner_config=refiner, budget="none", progress=False, **settings)
    assert ours.report.notes[-1].startswith("refiner model: tiny-refiner.safetensors, a Stable Diffusion XL refiner")
    assert np.array_equal(_pixels(ours), np.asarray(diffusers_refined_image(base, refiner, refiner_file=path, **settings),
                                                    dtype=np.int16))
