"""SD3 and SD3.5 as Stability keeps them (one all-in-one file, or the MMDiT alone), and the denoisers of Wan,
Qwen-Image, Chroma and Z-Image alone in their files (ComfyUI's ``diffusion_models/``), opened as ``--model FILE``:
the same model as the diffusers folder, bit for bit, with no budget and with one that streams from the file.

The files are the tiny pipelines written that way (memfit.testing.single_file: diffusers' conversions run
backwards). Where diffusers loads the file itself (SD3's whole pipeline; Wan's, Qwen-Image's and Z-Image's
transformers), memfit's image is diffusers' too; Chroma's converter assumes the real width, so there memfit's
conversion is held to it on the meta device at that width, and the tiny file's image to the folder's.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import memfit
from memfit.errors import MemfitError
from memfit.models.folder import ModelFolder
from memfit.models.single_file import SingleFileModel, detect_family, file_places
from memfit.testing import diffusers_output, max_pixel_difference, save_pipeline

IMAGE = {"prompt": "a red house near the sea", "steps": 2, "seed": 3, "width": 32, "height": 32}
WAN = {**IMAGE, "prompt": "a red circle drifting right", "frames": 5}
SETTINGS = {"wan": WAN, "qwenimage": IMAGE, "chroma": IMAGE, "zimage": IMAGE}
CLASSES = {"wan": "WanTransformer3DModel", "qwenimage": "QwenImageTransformer2DModel",
           "chroma": "ChromaTransformer2DModel", "zimage": "ZImageTransformer2DModel"}
FAMILY_TYPES = {"wan": "wan-t2v-1.3B", "qwenimage": "qwen-image", "chroma": "chroma", "zimage": "z-image-turbo"}
LABELS = {"wan": "Wan text-to-video 1.3B", "qwenimage": "Qwen-Image", "chroma": "Chroma", "zimage": "Z-Image"}
# ComfyUI's diffusion_models/ files keep the denoiser alone; some carry the all-in-one prefix even so.
PREFIXES = {"wan": "", "qwenimage": "", "chroma": "model.diffusion_model.", "zimage": "model.diffusion_model."}


def _frames(result) -> list:
    return list(result.frames) if getattr(result, "frames", None) else list(result.images)


def _configs_only(folder: Path, out: Path) -> Path:
    shutil.copytree(folder, out, ignore=shutil.ignore_patterns("*.safetensors"))
    return out


def _assert_views(module, path: Path, materialized: set[str]) -> None:
    """Every live parameter of ``module`` but ``materialized`` is a view of ``path``'s map."""
    places = file_places(module)
    assert places.path == path and places.materialized == materialized, (places.path, sorted(places.materialized))
    for live, param in module.named_parameters():
        if live not in places.materialized:
            assert param.data_ptr() == places.view(live)[2].data_ptr(), live


# -- SD3 -------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def sd3(tmp_path_factory):
    """(a tiny SD3 folder, the same model as Stability's all-in-one file, the folder's image). Its CLIP-L projection
    is the identity (Stability's files hold none, and SD3 runs theirs as the identity), its CLIP-G wider than its
    CLIP-L (diffusers tells them apart by width)."""
    from memfit.testing.single_file import save_sd3_checkpoint

    root = tmp_path_factory.mktemp("sd3")
    folder = save_pipeline("sd3_single_file", root / "sd3", seed=0)
    path = save_sd3_checkpoint(folder, root / "sd3_medium_incl_clips_t5xxlfp16.safetensors")
    image = _frames(memfit.generate(model=folder, budget="none", progress=False, **IMAGE))
    return folder, path, image


def test_an_sd3_checkpoint_equals_diffusers_single_file_and_the_folder(sd3, capsys):
    """Stability's all-in-one file: the MMDiT, the VAE in LDM keys and the three text encoders under their prefixes,
    each read as views of the file (only the swapped modulations and CLIP-L's identity projection computed); the
    image is diffusers' from_single_file's and the folder's; planned from its header as the folder is."""
    import diffusers

    from memfit.cli.app import main

    folder, path, image = sd3
    ours = memfit.generate(model=path, config=folder, budget="none", progress=False, **IMAGE)
    assert ours.report.notes[0] == (f"model: {path.name}, a Stable Diffusion 3 single-file checkpoint "
                                    f"(StableDiffusion3Pipeline); configs and tokenizers from --config {folder}")
    assert max_pixel_difference(_frames(ours), image) == 0
    pipe = diffusers.StableDiffusion3Pipeline.from_single_file(str(path), config=str(folder), local_files_only=True,
                                                               torch_dtype=torch.float32)
    names = ["transformer", "vae", "text_encoder", "text_encoder_2", "text_encoder_3"]
    # diffusers' single-file loading leaves the T5 encoder in training mode (its dropout on): as from_pretrained, eval.
    theirs = diffusers_output(folder, ours.settings, components={name: getattr(pipe, name).eval() for name in names})
    assert max_pixel_difference(_frames(ours), theirs) == 0

    model = SingleFileModel.open_file(path, config=folder)
    assert list(model.weights) == names
    loaded = model.load_stage(names, torch.float32, in_file_dtype=names)
    swapped = {"norm_out.linear.weight", "norm_out.linear.bias", "transformer_blocks.1.norm1_context.linear.weight",
               "transformer_blocks.1.norm1_context.linear.bias"}
    computed = {"transformer": swapped, "text_encoder": {"text_projection.weight"}}
    for name in names:
        _assert_views(getattr(loaded, name), path, computed.get(name, set()))
    assert file_places(loaded.transformer).places["transformer_blocks.0.attn.to_v.weight"].key == \
        "model.diffusion_model.joint_blocks.0.x_block.attn.qkv.weight"

    plans = []
    for args in ([str(path), "--config", str(folder)], [str(folder)]):
        assert main(["plan", "--model", *args, "--budget", "64MiB", "--process-memory", "0", "--json"]) == 0
        plans.append(json.loads(capsys.readouterr().out)["plan"])
    assert [plan["budget"].pop("disk") for plan in plans] == [str(path), str(folder)]
    assert plans[0] == plans[1]


def test_an_sd3_checkpoint_streams_under_a_budget(sd3, streamed_plans):
    from conftest import smallest_budget

    folder, path, image = sd3
    budget = smallest_budget(model=path, config=folder, **{**IMAGE, "steps": 1})
    assert budget < path.stat().st_size
    streamed_plans.clear()
    ours = memfit.generate(model=path, config=folder, budget=budget, progress=False, **IMAGE)
    streamed = {plan.stages[0].name: plan.stages[0].streamed_from_disk_bytes for plan in streamed_plans}
    assert streamed["denoise"] > 0, streamed
    assert max_pixel_difference(_frames(ours), image) == 0


def test_an_sd3_transformer_alone_takes_the_rest_from_config(sd3, tmp_path):
    """sd3.5_large.safetensors holds the MMDiT alone: the VAE and text encoders come from the config folder, or from
    files of their own; a config folder without their weights names the flags."""
    from memfit.testing.single_file import sd3_states

    folder, _, image = sd3
    states = sd3_states(folder)
    transformer = tmp_path / "sd3.5_large.safetensors"
    save_file({key: value.contiguous() for key, value in states["transformer"].items()}, transformer)
    ours = memfit.generate(model=transformer, config=folder, budget="none", progress=False, **IMAGE)
    assert ours.report.notes[0].endswith(f"vae, text_encoder, text_encoder_2, text_encoder_3 not in the file: read "
                                         f"from {folder}")
    assert max_pixel_difference(_frames(ours), image) == 0
    configs_only = _configs_only(folder, tmp_path / "configs")
    with pytest.raises(MemfitError, match=r"holds no vae \(AutoencoderKL\), text_encoder \(CLIPTextModelWithProjection\)"
                                          r".* give --component vae=FILE .*--component text_encoder=FILE \(e.g. "
                                          r"clip_l.safetensors\)"):
        memfit.generate(model=transformer, config=configs_only, budget="none", progress=False, **IMAGE)
    # A CLIP-L file of its own is read in transformers' names as it is: this one holds SD3's (identity) projection.
    width = states["text_encoder"]["text_model.embeddings.token_embedding.weight"].shape[1]
    states["text_encoder"]["text_projection.weight"] = torch.eye(width)
    files = {}
    for name in ("vae", "text_encoder", "text_encoder_2", "text_encoder_3"):
        files[name] = tmp_path / f"{name}.safetensors"
        save_file({key: value.contiguous() for key, value in states[name].items()}, files[name])
    ours = memfit.generate(model=transformer, config=configs_only, components=files, budget="none", progress=False,
                           **IMAGE)
    assert max_pixel_difference(_frames(ours), image) == 0


@pytest.mark.parametrize("changes, model_type", [({}, "sd3"), ({"qk_norm": "rms_norm"}, "sd35_large"),
                                                 ({"qk_norm": "rms_norm", "dual_attention_layers": (0,)}, "sd35_medium")])
def test_sd3_sizes_are_told_apart_by_structure(changes, model_type):
    """diffusers tells SD3 Medium, SD3.5 Large and SD3.5 Medium apart by the released models' widths and depths,
    which a file of another size lacks: memfit by their q/k norms and second attention, alone or prefixed."""
    from diffusers import SD3Transformer2DModel

    from memfit.testing.single_file import sd3_mmdit_state_dict

    model = SD3Transformer2DModel(sample_size=16, num_layers=2, attention_head_dim=8, num_attention_heads=2,
                                  joint_attention_dim=16, caption_projection_dim=16, pooled_projection_dim=16,
                                  pos_embed_max_size=16, **changes)
    shapes = {key: (value.dtype, list(value.shape)) for key, value in sd3_mmdit_state_dict(model).items()}
    assert detect_family(Path("a.safetensors"), shapes).model_type == model_type
    prefixed = {"model.diffusion_model." + key: value for key, value in shapes.items()}
    assert detect_family(Path("a.safetensors"), prefixed).model_type == model_type


# -- Denoisers alone: Wan, Qwen-Image, Chroma, Z-Image ----------------------------------------------------

def test_a_wan_image_to_video_transformer_is_refused_naming_what_diffusers_calls_it():
    """Wan's image-to-video transformer (its image embedder), which memfit does not run, whatever its width."""
    shapes = {"blocks.0.self_attn.q.weight": (torch.float32, [24, 24]), "head.modulation": (torch.float32, [1, 2, 24]),
              "patch_embedding.weight": (torch.float32, [24, 36, 1, 2, 2]),
              "img_emb.proj.1.weight": (torch.float32, [24, 16])}
    with pytest.raises(MemfitError, match="is a checkpoint diffusers calls 'wan-i2v-14B', which memfit cannot open"):
        detect_family(Path("wan2.1_i2v_480p_14B_fp16.safetensors"), shapes)
    text_to_video = {key: value for key, value in shapes.items() if not key.startswith("img_emb.")}
    assert detect_family(Path("wan2.1_t2v_1.3B_fp16.safetensors"), text_to_video).model_type == "wan-t2v-1.3B"
    for width, model_type in ((3072, "wan-ti2v-5B"), (5120, "wan-t2v-14B")):
        wide = {**text_to_video, "patch_embedding.weight": (torch.float32, [width, 48, 1, 2, 2])}
        assert detect_family(Path("wan.safetensors"), wide).model_type == model_type


def _original_state(folder: Path, kind: str) -> dict[str, torch.Tensor]:
    import diffusers

    from memfit.testing.single_file import (
        chroma_original_state_dict,
        wan_original_state_dict,
        z_image_original_state_dict,
    )

    transformer = getattr(diffusers, CLASSES[kind]).from_pretrained(folder / "transformer")
    to_file = {"wan": wan_original_state_dict, "chroma": chroma_original_state_dict,
               "zimage": z_image_original_state_dict}.get(kind, lambda model: model.state_dict())
    return dict(to_file(transformer))


@pytest.fixture(scope="module")
def denoisers(tiny_models, tmp_path_factory):
    """kind -> (its tiny folder, its transformer alone in its original keys, the folder's image)."""
    root = tmp_path_factory.mktemp("denoisers")
    made = {}

    def get(kind):
        if kind not in made:
            folder = Path(tiny_models(kind))
            path = root / f"{kind}-transformer.safetensors"
            save_file({PREFIXES[kind] + key: value.contiguous() for key, value in _original_state(folder, kind).items()},
                      path)
            image = _frames(memfit.generate(model=folder, budget="none", progress=False, **SETTINGS[kind]))
            made[kind] = folder, path, image
        return made[kind]

    return get


@pytest.mark.parametrize("kind", ["wan", "qwenimage", "chroma", "zimage"])
def test_a_denoiser_alone_as_the_model_draws_the_folders_image(denoisers, kind):
    """--model TRANSFORMER.safetensors --config DIR: the family from the file's header, every other model from the
    folder; every weight a view of the file; diffusers' own from_single_file of the transformer draws the same."""
    import diffusers

    folder, path, image = denoisers(kind)
    settings = SETTINGS[kind]
    assert detect_family(path, SingleFileModel.open_file(path, config=folder).weights["transformer"].checkpoint.shapes
                         ).model_type == FAMILY_TYPES[kind]
    ours = memfit.generate(model=path, config=folder, budget="none", progress=False, **settings)
    others = [name for name in ModelFolder.open(folder).model_components if name != "transformer"]
    assert ours.report.notes[0] == (f"model: {path.name}, a {LABELS[kind]} single-file checkpoint "
                                    f"({ModelFolder.open(folder).class_name}); configs and tokenizers from --config "
                                    f"{folder}; {', '.join(others)} not in the file: read from {folder}")
    assert max_pixel_difference(_frames(ours), image) == 0
    model = SingleFileModel.open_file(path, config=folder)
    transformer = model.load_stage(["transformer"], torch.float32, in_file_dtype=["transformer"]).transformer
    _assert_views(transformer, path, set())
    if kind != "chroma":  # diffusers' Chroma converter assumes the real width: see the test below
        theirs = getattr(diffusers, CLASSES[kind]).from_single_file(str(path), config=str(folder), subfolder="transformer",
                                                                   torch_dtype=torch.float32, local_files_only=True)
        assert max_pixel_difference(_frames(ours), diffusers_output(folder, ours.settings,
                                                                    components={"transformer": theirs})) == 0


@pytest.mark.parametrize("kind", ["wan", "chroma", "zimage"])
def test_a_denoiser_alone_streams_under_a_budget(denoisers, kind, streamed_plans):
    from conftest import smallest_budget

    folder, path, image = denoisers(kind)
    settings = SETTINGS[kind]
    budget = smallest_budget(model=path, config=folder, **{**settings, "steps": 1})
    streamed_plans.clear()
    ours = memfit.generate(model=path, config=folder, budget=budget, progress=False, **settings)
    streamed = {plan.stages[0].name: plan.stages[0].streamed_from_disk_bytes for plan in streamed_plans}
    assert streamed["denoise"] > 0, streamed
    assert max_pixel_difference(_frames(ours), image) == 0


@pytest.mark.parametrize("kind", ["wan", "zimage"])
def test_a_gguf_denoiser_alone_as_the_model_is_the_same_file_as_a_component(tmp_path, kind):
    """A GGUF Q8_0 transformer (city96's, QuantStack's) as --model: the family from its header's logical shapes, the
    image that of the same file as --component of the folder (held to diffusers' GGUF loading elsewhere)."""
    from memfit.quant.layers import QuantizedLinear
    from memfit.testing.quantized import save_gguf

    folder = save_pipeline(kind, tmp_path / kind, seed=0, scale=4 if kind == "wan" else 1)
    path = save_gguf(_original_state(folder, kind), tmp_path / f"{kind}-Q8_0.gguf", "Q8_0", architecture=kind,
                     keep=lambda key: key.endswith("modulation"))
    settings = SETTINGS[kind]
    ours = memfit.generate(model=path, config=folder, budget="none", progress=False, **settings)
    expected = memfit.generate(model=folder, components={"transformer": path}, budget="none", progress=False, **settings)
    assert max_pixel_difference(_frames(ours), _frames(expected)) == 0
    assert ours.report.notes[0].startswith(f"model: {path.name}, a {LABELS[kind]} single-file checkpoint")
    model = SingleFileModel.open_file(path, config=folder)
    transformer = model.load_stage(["transformer"], torch.float32, in_file_dtype=[]).transformer
    block = transformer.blocks[0].attn1 if kind == "wan" else transformer.layers[0].attention
    assert isinstance(block.to_k, QuantizedLinear) and block.to_k.format.name == "Q8_0"


@pytest.mark.parametrize("kind", ["chroma", "zimage"])
def test_a_chroma_or_z_image_transformer_as_a_component(denoisers, kind):
    """--component transformer=FILE reads Chroma's and Z-Image's original keys too."""
    folder, path, image = denoisers(kind)
    ours = memfit.generate(model=folder, components={"transformer": path}, budget="none", progress=False, **SETTINGS[kind])
    assert f"transformer from {path} ({ {'chroma': 'Chroma', 'zimage': 'Z-Image'}[kind]} layout)" in ours.report.notes[0]
    assert max_pixel_difference(_frames(ours), image) == 0


def test_chroma_converts_as_diffusers_converts_it_at_the_real_width():
    """On the meta device, at Chroma's real width with one block of each kind: memfit's conversion of Chroma's keys
    gives diffusers' converter's names and shapes, which are the model's own."""
    from accelerate import init_empty_weights
    from diffusers import ChromaTransformer2DModel
    from diffusers.loaders.single_file_utils import (
        convert_chroma_transformer_checkpoint_to_diffusers,
    )

    from memfit.models.weight_layouts import CHROMA
    from memfit.testing.single_file import chroma_original_state_dict

    with init_empty_weights():
        model = ChromaTransformer2DModel(num_layers=1, num_single_layers=1, approximator_layers=1)
    stored = chroma_original_state_dict(model)
    theirs = convert_chroma_transformer_checkpoint_to_diffusers(dict(stored))
    ours = CHROMA.convert(dict(stored), dict(model.config), model)
    assert {key: tuple(value.shape) for key, value in ours.items()} == \
        {key: tuple(value.shape) for key, value in theirs.items()} == \
        {key: tuple(value.shape) for key, value in model.state_dict().items()}


@pytest.mark.parametrize("kind, repository", [("chroma", "lodestones/Chroma1-HD"), ("qwenimage", "Qwen/Qwen-Image")])
def test_a_denoiser_alone_offline_without_configs_names_the_three_ways(denoisers, kind, repository, tmp_path,
                                                                         monkeypatch):
    _, path, _ = denoisers(kind)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "no-cache"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    with pytest.raises(MemfitError) as refused:
        memfit.generate(model=path, budget="none", progress=False, **SETTINGS[kind])
    message = str(refused.value)
    assert f"is a {LABELS[kind]} checkpoint, which holds weights but no configs or tokenizers" in message
    assert "pass --config DIR" in message and f"huggingface-cli download {repository}" in message
    assert "run once online" in message


def test_a_file_of_no_known_layout_names_its_groups(tmp_path):
    path = tmp_path / "mystery.safetensors"
    save_file({"double_stream.0.mod.weight": torch.zeros(4, 4), "img_proj.bias": torch.zeros(4)}, path)
    with pytest.raises(MemfitError, match=r"holds 2 tensors in a layout memfit does not recognise \(double_stream\.\* "
                                          r"\(1\), img_proj\.\* \(1\)\); memfit opens all-in-one checkpoints of: .*"
                                          r"Stable Diffusion 3 \(.*Chroma \(model\.diffusion_model\.\* or the "
                                          r"transformer alone\)"):
        memfit.generate(model=path, budget="none", progress=False, **IMAGE)
