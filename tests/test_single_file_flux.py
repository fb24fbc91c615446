"""Flux as ComfyUI keeps it: the transformer alone in Black Forest Labs' keys, ae.safetensors, clip_l and t5xxl
files, or one all-in-one checkpoint; memfit opens them as the same model as a diffusers folder.

The files are the tiny Flux pipeline written that way (memfit.testing.single_file, the inverse of
diffusers' conversion). diffusers' own Flux converter assumes the real width, 3072: memfit's converter
is held to it on the meta device at that width, and the tiny files' images to the folder's, bit for bit.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

import memfit
from memfit.models.folder import ModelFolder
from memfit.models.single_file import SingleFileModel, detect_family, file_places
from memfit.testing.single_file import save_flux_checkpoint, save_flux_files

SETTINGS = dict(prompt="a red house near the sea", steps=2, seed=3, width=32, height=32)


@pytest.fixture(scope="module")
def flux(tiny_models, tmp_path_factory):
    """(the tiny Flux folder, its split files: component -> file, the image memfit draws from the folder)."""
    folder = Path(tiny_models("flux"))
    files = save_flux_files(folder, tmp_path_factory.mktemp("flux-files"))
    image = _pixels(memfit.generate(model=folder, budget="none", progress=False, **SETTINGS))
    return folder, files, image


def _pixels(result):
    return np.asarray(result.images[0], dtype=np.int16)


def test_the_transformer_converts_as_diffusers_converts_it_at_the_real_width():
    """On the meta device (no data), at Flux's real width with one block of each kind: memfit's conversion of a
    Black Forest Labs file gives diffusers' converter's names and shapes, which are the model's own."""
    from accelerate import init_empty_weights
    from diffusers import FluxTransformer2DModel
    from diffusers.loaders.single_file_utils import convert_flux_transformer_checkpoint_to_diffusers

    from memfit.models.weight_layouts import BFL_FLUX
    from memfit.testing.single_file import flux_bfl_state_dict

    with init_empty_weights():
        model = FluxTransformer2DModel(num_layers=1, num_single_layers=1, guidance_embeds=True)
    stored = flux_bfl_state_dict(model)
    assert "double_blocks.0.img_attn.qkv.weight" in stored and stored["single_blocks.0.linear1.weight"].shape == \
        (3 * 3072 + 4 * 3072, 3072)
    theirs = convert_flux_transformer_checkpoint_to_diffusers(dict(stored))
    ours = BFL_FLUX.convert(dict(stored), dict(model.config), model)
    assert {key: tuple(value.shape) for key, value in ours.items()} == \
        {key: tuple(value.shape) for key, value in theirs.items()} == \
        {key: tuple(value.shape) for key, value in model.state_dict().items()}
    # The family, from names and shapes alone: [schnell] has no guidance embedder.
    shapes = {key: (value.dtype, list(value.shape)) for key, value in stored.items()}
    assert detect_family(Path("flux1-dev.safetensors"), shapes).model_type == "flux-dev"
    schnell = {key: value for key, value in shapes.items() if not key.startswith("guidance_in.")}
    assert detect_family(Path("flux1-schnell.safetensors"), schnell).model_type == "flux-schnell"


def test_split_files_give_the_folders_image_reading_views_of_the_files(flux):
    """--component for every model of a Flux folder (ComfyUI's split layout): each is read from its file, the
    fused projections as row slices of it; only the final norm's swapped modulation is computed; T5's tied
    embedding is one tensor, a view of the file."""
    folder, files, image = flux
    ours = memfit.generate(model=folder, components=files, budget="none", progress=False, **SETTINGS)
    assert np.array_equal(_pixels(ours), image)
    assert ours.report.notes[0].startswith(f"components from files of their own: transformer from {files['transformer']} "
                                           "(Black Forest Labs layout), vae from")
    model = SingleFileModel.with_components(ModelFolder.open(folder), files)
    names = list(files)
    pipe = model.load_stage(names, torch.float32, in_file_dtype=names)
    places = file_places(pipe.transformer)
    assert places.materialized == {"norm_out.linear.weight", "norm_out.linear.bias"}
    assert places.places["transformer_blocks.0.attn.to_k.weight"].key == "double_blocks.0.img_attn.qkv.weight"
    assert places.places["single_transformer_blocks.0.proj_mlp.weight"].key == "single_blocks.0.linear1.weight"
    for name in names:
        module, places = getattr(pipe, name), file_places(getattr(pipe, name))
        assert places.path == files[name]
        for live, param in module.named_parameters():
            if live not in places.materialized:
                assert param.data_ptr() == places.view(live)[2].data_ptr(), (name, live)
    t5 = pipe.text_encoder_2
    assert t5.encoder.embed_tokens.weight is t5.shared.weight


def test_split_files_stream_under_a_budget(flux, streamed_plans):
    """The transformer and the VAE stream from their files under the smallest budget of the run, the text
    encoders (T5's tied embedding included) under the smallest of the encode stage alone."""
    import re

    from conftest import smallest_budget

    from memfit.errors import MemfitError

    folder, files, image = flux
    budget = smallest_budget(model=folder, components=files, **dict(SETTINGS, steps=1))
    assert budget < files["transformer"].stat().st_size
    streamed_plans.clear()
    ours = memfit.generate(model=folder, components=files, budget=budget, progress=False, **SETTINGS)
    streamed = {plan.stages[0].name: plan.stages[0].streamed_from_disk_bytes for plan in streamed_plans}
    assert streamed["denoise"] > 0 and streamed["decode"] > 0, streamed
    assert np.array_equal(_pixels(ours), image)
    expected, _ = memfit.encode(SETTINGS["prompt"], model=folder, budget="none")
    with pytest.raises(MemfitError) as refused:
        memfit.encode(SETTINGS["prompt"], model=folder, components=files, budget=1)
    budget = int(re.search(r"smallest budget that works is (\d+) bytes", str(refused.value)).group(1))
    streamed_plans.clear()
    embeddings, _ = memfit.encode(SETTINGS["prompt"], model=folder, components=files, budget=budget)
    assert streamed_plans[0].stages[0].streamed_from_disk_bytes > 0
    assert all(torch.equal(embeddings.tensors[key], expected.tensors[key]) for key in expected.tensors)


def test_a_transformer_file_as_the_model_takes_the_rest_from_config(flux, tmp_path):
    """--model flux1-dev.safetensors --config DIR: the family from the file's header; the VAE and text encoders
    from the folder, or from files of their own; a config folder without their weights names the flag."""
    import shutil

    from memfit.errors import MemfitError

    folder, files, image = flux
    transformer = files["transformer"]
    ours = memfit.generate(model=transformer, config=folder, budget="none", progress=False, **SETTINGS)
    assert ours.report.notes[0] == (f"model: flux1-dev.safetensors, a Flux.1 [dev] single-file checkpoint (FluxPipeline); "
                                    f"configs and tokenizers from --config {folder}; vae, text_encoder, text_encoder_2 "
                                    f"not in the file: read from {folder}")
    assert np.array_equal(_pixels(ours), image)
    configs_only = tmp_path / "configs"
    shutil.copytree(folder, configs_only, ignore=shutil.ignore_patterns("*.safetensors"))
    with pytest.raises(MemfitError, match=r"holds no vae \(AutoencoderKL\), text_encoder \(CLIPTextModel\), "
                                          r"text_encoder_2 \(T5EncoderModel\), and .* give --component vae=FILE "
                                          r"\(e.g. ae.safetensors\), --component text_encoder=FILE"):
        memfit.generate(model=transformer, config=configs_only, budget="none", progress=False, **SETTINGS)
    others = {name: path for name, path in files.items() if name != "transformer"}
    ours = memfit.generate(model=transformer, config=configs_only, components=others, budget="none", progress=False,
                           **SETTINGS)
    assert np.array_equal(_pixels(ours), image)


def test_an_all_in_one_flux_checkpoint(flux, tmp_path, capsys):
    """ComfyUI's all-in-one Flux checkpoint: the four models under the prefixes diffusers' loader reads; planned
    from its header as the folder is."""
    from memfit.cli.app import main
    folder, _, image = flux
    path = save_flux_checkpoint(folder, tmp_path / "flux1-dev-aio.safetensors")
    ours = memfit.generate(model=path, config=folder, budget="none", progress=False, **SETTINGS)
    assert ours.report.notes[0] == (f"model: flux1-dev-aio.safetensors, a Flux.1 [dev] single-file checkpoint "
                                    f"(FluxPipeline); configs and tokenizers from --config {folder}")
    assert np.array_equal(_pixels(ours), image)
    model = SingleFileModel.open_file(path, config=folder)
    assert {name: weights.prefix for name, weights in model.weights.items()} == {
        "transformer": "model.diffusion_model.", "vae": "vae.", "text_encoder": "text_encoders.clip_l.transformer.",
        "text_encoder_2": "text_encoders.t5xxl.transformer."}
    plans = []
    for args in ([str(path), "--config", str(folder)], [str(folder)]):
        assert main(["plan", "--model", *args, "--budget", "64MiB", "--process-memory", "0", "--json"]) == 0
        plans.append(json.loads(capsys.readouterr().out)["plan"])
    assert [plan["budget"].pop("disk") for plan in plans] == [str(path), str(folder)]  # each streams from its own
    assert plans[0] == plans[1]


def test_a_comfyui_models_folder_pairs_a_flux_transformer_with_its_files(flux, tiny_models, tmp_path):
    """memfit serve --models-dir over ComfyUI's split layout: the transformer in diffusion_models/ is paired, by
    family, with the VAE and text encoders of vae/ and text_encoders/ that fit it (an SD VAE listed first is
    passed over), and runs as --component would run them; a missing one is the entry's reason."""
    import shutil

    from memfit.models.library import ModelsDir, config_folders, open_entry

    folder, files, image = flux
    configs_only = tmp_path / "configs"
    shutil.copytree(folder, configs_only, ignore=shutil.ignore_patterns("*.safetensors"))
    models = tmp_path / "ComfyUI" / "models"
    for sub, names in {"diffusion_models": ["transformer"], "vae": ["vae"],
                       "text_encoders": ["text_encoder", "text_encoder_2"]}.items():
        (models / sub).mkdir(parents=True)
        for name in names:
            (models / sub / files[name].name).symlink_to(files[name])
    shutil.copy(Path(tiny_models("sd")) / "vae" / "diffusion_pytorch_model.safetensors", models / "vae" / "a-sd.safetensors")
    library = ModelsDir(models.parent, configs=config_folders([configs_only]))
    entry = next(entry for entry in library.scan().checkpoints if entry.kind == "split")
    paired = {name: path.name for name, path in entry.components}
    assert (entry.name, entry.error, entry.pipeline) == ("diffusion_models/flux1-dev.safetensors", "", "FluxPipeline")
    assert paired == {"vae": "ae.safetensors", "text_encoder": "clip_l.safetensors",
                      "text_encoder_2": "t5xxl_fp16.safetensors"}
    model = open_entry(entry, configs=library.configs)
    assert [path.name for path in model.weight_files("text_encoder_2")] == ["t5xxl_fp16.safetensors"]
    ours = memfit.generate(model=entry.path, config=configs_only, components=dict(entry.components), budget="none",
                           progress=False, **SETTINGS)
    assert np.array_equal(_pixels(ours), image)

    (models / "text_encoders" / files["text_encoder_2"].name).unlink()
    lacking = next(entry for entry in library.scan().checkpoints if entry.kind == "split")
    assert "no file of the models folder fits its text_encoder_2 (T5EncoderModel, e.g. t5xxl_fp16.safetensors) in " \
           "text_encoders/" in lacking.error and not lacking.pipeline
