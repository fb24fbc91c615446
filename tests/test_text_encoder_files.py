"""Qwen text encoders as ComfyUI's ``models/text_encoders/`` holds them, given with ``--component text_encoder=FILE``:
Qwen-Image's Qwen2.5-VL (``qwen_2.5_vl_7b.safetensors``: transformers' older layout, ``model.layers``, ``visual.blocks``)
and Z-Image's Qwen3 (``qwen_3_4b.safetensors``: Qwen3ForCausalLM's names over the Qwen3Model the pipeline runs), as
safetensors, fp8 "scaled" safetensors and llama.cpp's GGUF. Every weight is a view of the file; the images are the
folder's own, bit for bit, or (quantized) the image of the same values upcast when loaded.

The files are the tiny pipelines' encoders written in those layouts (the inverse of the renames memfit reads them by).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

import memfit
from memfit.errors import MemfitError
from memfit.models.folder import ModelFolder
from memfit.models.single_file import SingleFileModel, file_places
from memfit.quant.layers import QuantizedLinear

SETTINGS = {"prompt": "a red house near the sea", "steps": 2, "seed": 3, "width": 32, "height": 32}


@pytest.fixture(autouse=True)
def no_prompt_cache(monkeypatch):
    """Every run encodes its prompt with the encoder it was given (the prompt cache would hand a run the embedding
    another encoder of the same fingerprint made)."""
    monkeypatch.setenv("MEMFIT_CACHE", "0")


def _encoder_state(folder: Path) -> dict[str, torch.Tensor]:
    """The folder's text encoder in the installed transformers' own names."""
    from memfit.models.folder import ModelFolder

    pipe = ModelFolder.open(folder).load_stage(["text_encoder"], torch.float32)
    return {key: value.detach().clone() for key, value in pipe.text_encoder.state_dict().items()}


def _case(tiny_models, tmp_path_factory, kind: str, files: str):
    """(the tiny ``kind`` folder, a folder for its encoder's files, the encoder's state, the folder's image)."""
    folder = Path(tiny_models(kind))
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MEMFIT_CACHE", "0")
        image = _pixels(memfit.generate(model=folder, budget="none", progress=False, **SETTINGS))
    return folder, tmp_path_factory.mktemp(files), _encoder_state(folder), image


@pytest.fixture(scope="module")
def qwenimage(tiny_models, tmp_path_factory):
    return _case(tiny_models, tmp_path_factory, "qwenimage", "qwen25vl")


@pytest.fixture(scope="module")
def zimage(tiny_models, tmp_path_factory):
    return _case(tiny_models, tmp_path_factory, "zimage", "qwen3")


def _pixels(result):
    return np.asarray(result.images[0], dtype=np.int16)


def _comfy_qwen25_vl(state: dict) -> dict:
    """Qwen2.5-VL in transformers' older layout, as ComfyUI's qwen_2.5_vl_7b.safetensors holds it."""
    renamed = {}
    for key, value in state.items():
        if key.startswith("model.visual."):
            key = key.removeprefix("model.")
        elif key.startswith("model.language_model."):
            key = "model." + key.removeprefix("model.language_model.")
        renamed[key] = value
    assert "model.embed_tokens.weight" in renamed and "visual.patch_embed.proj.weight" in renamed
    return renamed


def _comfy_qwen3(state: dict) -> dict:
    """Qwen3Model's tensors in Qwen3ForCausalLM's names with its LM head, as ComfyUI's qwen_3_4b.safetensors."""
    renamed = {"model." + key: value for key, value in state.items()}
    renamed["lm_head.weight"] = torch.randn_like(state["embed_tokens.weight"])
    return renamed


def _generate(folder: Path, path: Path):
    return memfit.generate(model=folder, components={"text_encoder": path}, budget="none", progress=False, **SETTINGS)


def _loaded_encoder(folder: Path, path: Path, in_file_dtype: bool = True):
    model = SingleFileModel.with_components(ModelFolder.open(folder), {"text_encoder": path})
    return model.load_stage(["text_encoder"], torch.float32,
                            in_file_dtype=["text_encoder"] if in_file_dtype else []).text_encoder


@pytest.mark.parametrize("layout", ["comfyui", "transformers"])
def test_a_qwen25_vl_file_draws_the_folders_image_from_views(qwenimage, layout):
    """ComfyUI's older names and the installed transformers' own: the folder's image, bit for bit, every weight a
    view of the file."""
    folder, out, state, image = qwenimage
    path = out / f"qwen_2.5_vl_7b-{layout}.safetensors"
    save_file(_comfy_qwen25_vl(state) if layout == "comfyui" else state, str(path))
    ours = _generate(folder, path)
    assert np.array_equal(_pixels(ours), image)
    assert "text_encoder from " in ours.report.notes[0] and "(transformers layout)" in ours.report.notes[0]
    places = file_places(_loaded_encoder(folder, path))
    assert set(places.places) == set(state) and not places.materialized


def test_a_text_only_qwen25_vl_file_leaves_the_vision_tower_out(qwenimage):
    """A file with no vision tower and no LM head (text-only exports): text-to-image never runs the tower, so it
    is left out of the model; the LM head, whose logits no pipeline reads, is the token embedding. The image is the
    folder's; giving the encoder an image names what the file lacked."""
    folder, out, state, image = qwenimage
    comfy = _comfy_qwen25_vl(state)
    path = out / "qwen_2.5_vl_7b-text-only.safetensors"
    save_file({key: value for key, value in comfy.items() if not key.startswith("visual.") and key != "lm_head.weight"},
              str(path))
    assert np.array_equal(_pixels(_generate(folder, path)), image)
    encoder = _loaded_encoder(folder, path)
    assert not any(key.startswith("model.visual.") for key in encoder.state_dict())
    places = file_places(encoder)
    assert places.places["lm_head.weight"].key == "model.embed_tokens.weight" and not places.materialized
    with pytest.raises(MemfitError, match=r"no vision tower \(visual\.\* tensors\)"):
        encoder.model.visual(torch.zeros(4, 16))


def test_a_qwen25_vl_file_missing_part_of_its_vision_tower_is_refused(qwenimage):
    folder, out, state, _ = qwenimage
    comfy = _comfy_qwen25_vl(state)
    path = out / "qwen_2.5_vl_7b-partial.safetensors"
    save_file({key: value for key, value in comfy.items() if key != "visual.merger.ln_q.weight"}, str(path))
    with pytest.raises(MemfitError, match=r"has no tensor 'model\.visual\.merger\.ln_q\.weight', which text_encoder "
                                          r"\(Qwen2_5_VLForConditionalGeneration\) needs"):
        _generate(folder, path)


@pytest.mark.parametrize("layout", ["comfyui", "transformers"])
def test_a_qwen3_file_draws_the_folders_image_from_views(zimage, layout):
    """Qwen3ForCausalLM's names with an LM head the Qwen3Model has no place for (dropped), or Qwen3Model's own."""
    folder, out, state, image = zimage
    path = out / f"qwen_3_4b-{layout}.safetensors"
    save_file(_comfy_qwen3(state) if layout == "comfyui" else state, str(path))
    assert np.array_equal(_pixels(_generate(folder, path)), image)
    places = file_places(_loaded_encoder(folder, path))
    assert set(places.places) == set(state) and not places.materialized


@pytest.mark.parametrize("kind", ["qwenimage", "zimage"])
def test_fp8_scaled_files_draw_the_upcast_image(qwenimage, zimage, kind):
    """As Comfy's ``*_fp8_scaled`` text encoders: each linear weight in fp8 e4m3fn over a float32 scale_weight. Held
    in fp8 and dequantized in each forward, they draw the image of the same values upcast when loaded, bit for bit,
    which is not the folder's."""
    from memfit.testing.quantized import save_fp8

    folder, out, state, image = qwenimage if kind == "qwenimage" else zimage
    comfy = _comfy_qwen25_vl(state) if kind == "qwenimage" else _comfy_qwen3(state)
    path = save_fp8(comfy, out / "fp8_scaled.safetensors", scaled=True)
    ours = _pixels(_generate(folder, path))

    stored = load_file(str(path))
    upcast = {key: value.to(torch.float32) * stored.get(key.removesuffix("weight") + "scale_weight", 1.0)
              for key, value in stored.items() if not key.endswith("scale_weight") and key != "scaled_fp8"}
    save_file(upcast, str(out / "upcast.safetensors"))
    assert np.array_equal(ours, _pixels(_generate(folder, out / "upcast.safetensors")))
    assert not np.array_equal(ours, image)
    encoder = _loaded_encoder(folder, path, in_file_dtype=False)
    layer = (encoder.model.language_model if kind == "qwenimage" else encoder).layers[0]
    assert isinstance(layer.self_attn.q_proj, QuantizedLinear) and layer.self_attn.q_proj.stored.scale is not None


def _gguf_state(state: dict, kind: str) -> dict:
    """The encoder as llama.cpp's converter names it (the gguf package's map): the text model alone, the vision
    tower being in a separate mmproj file."""
    import gguf

    architecture = gguf.MODEL_ARCH.QWEN2VL if kind == "qwenimage" else gguf.MODEL_ARCH.QWEN3
    legacy = _comfy_qwen25_vl(state) if kind == "qwenimage" else {"model." + key: value for key, value in state.items()}
    layers = 1 + max(int(key.split(".")[2]) for key in legacy if key.startswith("model.layers."))
    names = gguf.TensorNameMap(architecture, layers)
    renamed = {}
    for key, value in legacy.items():
        if key.startswith("visual."):
            continue
        name = names.get_name(key, try_suffixes=(".weight", ".bias"))
        assert name is not None, key
        renamed[name] = value
    return renamed


@pytest.mark.parametrize("quant_type", ["Q8_0", "Q4_0"])
@pytest.mark.parametrize("kind", ["qwenimage", "zimage"])
def test_a_gguf_file_in_llama_cpp_names_draws_diffusers_image_of_its_values(qwenimage, zimage, kind, quant_type):
    """llama.cpp's names (``blk.0.attn_q.weight``, ``token_embd.weight``), quantized where rows are whole blocks: read
    through the gguf package's own map, the image is diffusers' with the same values dequantized when loaded, bit for
    bit (Q4_0's, coarser than the tiny image's pixels, not the folder's); Qwen2.5-VL's text GGUF has no vision tower,
    which text-to-image does without."""
    import gguf
    from diffusers import DiffusionPipeline

    from memfit.models.weight_layouts import LLAMA_CPP_LM
    from memfit.quant.formats import gguf_format
    from memfit.quant.gguf_file import MappedGguf
    from memfit.testing.quantized import save_gguf

    folder, out, state, image = qwenimage if kind == "qwenimage" else zimage
    path = save_gguf(_gguf_state(state, kind), out / f"text-encoder-{quant_type}.gguf", quant_type,
                     architecture="qwen2vl" if kind == "qwenimage" else "qwen3")
    ours = _pixels(_generate(folder, path))

    mapped = MappedGguf(path)
    assert mapped.formats, "the tiny encoder has rows of whole Q8_0 blocks"
    dequantized = {key: gguf_format(int(gguf.GGMLQuantizationType[quant_type]), key).dequantize(mapped.tensor(key), torch.float32)
                   if key in mapped.formats else mapped.tensor(key).clone() for key in mapped.entries}
    pipe = DiffusionPipeline.from_pretrained(folder, torch_dtype=torch.float32)
    live = LLAMA_CPP_LM.convert(dequantized, {}, pipe.text_encoder)
    assert set(live) == {key for key in state if not key.startswith("model.visual.")}
    pipe.text_encoder.load_state_dict(live, strict=False)
    pipe.set_progress_bar_config(disable=True)
    theirs = pipe(prompt=SETTINGS["prompt"], num_inference_steps=SETTINGS["steps"], width=SETTINGS["width"],
                  height=SETTINGS["height"], generator=torch.Generator().manual_seed(SETTINGS["seed"])).images[0]
    assert np.array_equal(ours, np.asarray(theirs, dtype=np.int16))
    if quant_type == "Q4_0":
        assert not np.array_equal(ours, image)
    encoder = _loaded_encoder(folder, path, in_file_dtype=False)
    assert any(isinstance(module, QuantizedLinear) for module in encoder.modules())


def test_a_qwen_file_for_a_clip_encoder_names_the_layouts_read(qwenimage, tiny_models):
    _, out, state, _ = qwenimage
    path = out / "qwen_2.5_vl_7b.safetensors"
    save_file(_comfy_qwen25_vl(state), str(path))
    with pytest.raises(MemfitError) as refused:
        _generate(Path(tiny_models("sd")), path)
    message = str(refused.value)
    assert "holds no CLIPTextModel in a layout memfit reads (transformers ('text_model.embeddings.token_embedding" \
           ".weight'), OpenCLIP ('positional_embedding'))" in message
    assert "model.* (" in message and "visual.* (" in message


def test_a_bare_qwen3_file_for_flux2_klein_ties_its_lm_head(tiny_models, tmp_path):
    """FLUX.2 [klein] runs a Qwen3ForCausalLM: a file in Qwen3Model's names, with no LM head, draws the folder's image
    (the pipeline reads hidden states, never the logits); the head is the token embedding, no copy."""
    folder = Path(tiny_models("flux2_klein"))
    state = load_file(str(folder / "text_encoder" / "model.safetensors"))
    path = tmp_path / "qwen_3_4b-bare.safetensors"
    save_file({key.removeprefix("model."): value for key, value in state.items() if key != "lm_head.weight"}, str(path))
    image = _pixels(memfit.generate(model=folder, budget="none", progress=False, **SETTINGS))
    assert np.array_equal(_pixels(_generate(folder, path)), image)
    places = file_places(_loaded_encoder(folder, path))
    assert places.places["lm_head.weight"].key == "embed_tokens.weight" and not places.materialized


@pytest.mark.parametrize("file", ["text-only", "gguf"])
def test_text_only_files_stream_under_the_smallest_budget(qwenimage, streamed_plans, file):
    """A Qwen2.5-VL file without its vision tower (safetensors, or llama.cpp's Q8_0 GGUF) streams from its file under
    the smallest budget of the encode stage: the embeddings of the encode with no budget, bit for bit."""
    import re

    from memfit.testing.quantized import save_gguf

    folder, out, state, _ = qwenimage
    if file == "gguf":
        path = save_gguf(_gguf_state(state, "qwenimage"), out / "streamed-Q8_0.gguf", "Q8_0", architecture="qwen2vl")
    else:
        path = out / "streamed-text-only.safetensors"
        save_file({key: value for key, value in _comfy_qwen25_vl(state).items() if not key.startswith("visual.")},
                  str(path))
    components = {"text_encoder": path}
    expected, _ = memfit.encode(SETTINGS["prompt"], model=folder, components=components, budget="none")
    with pytest.raises(MemfitError) as refused:
        memfit.encode(SETTINGS["prompt"], model=folder, components=components, budget=1)
    budget = int(re.search(r"smallest budget that works is (\d+) bytes", str(refused.value)).group(1))
    streamed_plans.clear()
    embeddings, _ = memfit.encode(SETTINGS["prompt"], model=folder, components=components, budget=budget)
    assert streamed_plans[0].stages[0].streamed_from_disk_bytes > 0
    assert expected.tensors and all(torch.equal(embeddings.tensors[key], expected.tensors[key]) for key in expected.tensors)
