"""Bad input of every kind gets one sentence: exit 2, naming the thing at fault, no traceback,
no output file, and nothing else changed on disk (issue 17).

One table, one row per fault: folder faults, parameter faults, cache faults and output faults.
Extend it whenever a new flag or file format appears. A row is (id, make, expected): ``make(model,
tmp)`` gets a private copy of the tiny SD folder and a scratch folder, damages what it needs and
returns the extra CLI arguments (and environment, and another --model, or the tiny pipeline of another
``family``) of the run; ``expected`` must appear in the one line on stderr.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from memfit.cli.app import main

RUN = ["--steps", "1", "--width", "32", "--height", "32", "--quiet"]


def _weights(model: Path, component: str) -> Path:
    return next((model / component).glob("*.safetensors"))


def _edit(model: Path, component: str, change) -> None:
    path = _weights(model, component)
    tensors = load_file(path)
    change(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def _key(tensors, suffix: str) -> str:
    return sorted(k for k in tensors if k.endswith(suffix))[0]


def _index(model: Path, **changes) -> None:
    index = json.loads((model / "model_index.json").read_text())
    index.update(changes)
    (model / "model_index.json").write_text(json.dumps(index))


# -- folder faults ------------------------------------------------------------------------------

def no_unet(model, tmp):
    shutil.rmtree(model / "unet")


def no_vae(model, tmp):
    shutil.rmtree(model / "vae")


def no_unet_config(model, tmp):
    (model / "unet" / "config.json").unlink()


def missing_tensor(model, tmp):
    _edit(model, "unet", lambda t: t.pop(_key(t, "conv_out.weight")))


def missing_text_tensor(model, tmp):
    _edit(model, "text_encoder", lambda t: t.pop(_key(t, "final_layer_norm.weight")))


def extra_tensor(model, tmp):
    _edit(model, "unet", lambda t: t.__setitem__("bogus.weight", torch.zeros(3)))


def mixed_dtypes(model, tmp):
    def change(t):
        key = _key(t, "conv_in.weight")
        t[key] = t[key].half()

    _edit(model, "unet", change)


def wrong_shape(model, tmp):
    def change(t):
        key = _key(t, "conv_in.weight")
        t[key] = torch.zeros(*[n + 1 for n in t[key].shape])

    _edit(model, "unet", change)


def remote_code(model, tmp):
    _index(model, unet=["my_unet", "MyUNet"])


def unknown_pipeline_class(model, tmp):
    _index(model, _class_name="NoSuchPipeline")


def remote_code_auto_map(model, tmp):
    config = json.loads((model / "unet" / "config.json").read_text())
    config["auto_map"] = {"AutoModel": "modeling_my.MyUNet"}
    (model / "unet" / "config.json").write_text(json.dumps(config))


def pickle_weights(model, tmp):
    path = _weights(model, "text_encoder")
    torch.save(load_file(path), path.with_name("pytorch_model.bin"))
    path.unlink()


def nan_weights(component, suffix):
    def make(model, tmp):
        def change(t):
            key = _key(t, suffix)
            t[key] = torch.full_like(t[key], float("nan"))

        _edit(model, component, change)

    return make


# -- single-file checkpoint faults: the run names the file as --model --------------------------

def single_file(damage=None, *, config=True, env=None):
    """The tiny SD model as an all-in-one LDM checkpoint in ``tmp``, damaged by ``damage(path)`` (which may
    return another path to run); its configs from the folder unless ``config`` is False."""
    def make(model, tmp):
        from memfit.testing.single_file import save_single_file

        path = save_single_file(model, tmp / "tiny-sd.safetensors")
        path = (damage(path) if damage else None) or path
        return {"model": path, "args": ["--prompt", "a red circle", *(["--config", str(model)] if config else [])],
                "env": env or {}}

    return make


def _truncate(path):
    with path.open("r+b") as handle:
        handle.truncate(path.stat().st_size - 100)


def _unknown_layout(path):
    save_file({"double_stream.0.mod.weight": torch.zeros(4, 4), "img_proj.bias": torch.zeros(4)}, path)


def _as_ckpt(path):
    ckpt = path.with_suffix(".ckpt")
    torch.save({"state_dict": load_file(path)}, ckpt)
    path.unlink()
    return ckpt


def _mmdit_alone_offline(model, tmp):
    """A tiny SD3 transformer alone in Stability's MMDiT keys, run offline with no --config and an empty cache."""
    from diffusers import SD3Transformer2DModel

    from memfit.testing.single_file import sd3_mmdit_state_dict

    transformer = SD3Transformer2DModel(sample_size=16, num_layers=2, attention_head_dim=8, num_attention_heads=2,
                                        joint_attention_dim=16, caption_projection_dim=16, pooled_projection_dim=16,
                                        pos_embed_max_size=16)
    path = tmp / "sd3.5_large.safetensors"
    save_file({key: value.contiguous() for key, value in sd3_mmdit_state_dict(transformer).items()}, path)
    return {"model": path, "args": ["--prompt", "a red circle"],
            "env": {"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp / "empty-cache")}}


def _config_of_another_size(model, tmp):
    made = single_file()(model, tmp)
    config = json.loads((model / "unet" / "config.json").read_text())
    config["block_out_channels"] = [n * 2 for n in config["block_out_channels"]]
    (model / "unet" / "config.json").write_text(json.dumps(config))
    return made


# -- component file faults (--component NAME=FILE) ----------------------------------------------

def component(name, make_file):
    """``--component name=FILE`` with the file ``make_file(model, tmp)`` returns."""
    return lambda model, tmp: {"args": ["--prompt", "a red circle", "--component", f"{name}={make_file(model, tmp)}"]}


def _vae_with_latent_channels(channels):
    def make(model, tmp):
        from diffusers import AutoencoderKL

        from memfit.testing.single_file import ldm_vae_state_dict

        vae = AutoencoderKL.from_config({**AutoencoderKL.load_config(model / "vae"), "latent_channels": channels})
        save_file({k: v.contiguous() for k, v in ldm_vae_state_dict(vae).items()}, tmp / "vae.safetensors")
        return tmp / "vae.safetensors"

    return make


def _flux_transformer_state(width):
    """A Flux transformer of the tiny Flux run's architecture, ``width`` wide, in Black Forest Labs' keys (as
    ComfyUI's flux1-dev.safetensors)."""
    from diffusers import FluxTransformer2DModel

    from memfit.testing.single_file import flux_bfl_state_dict

    transformer = FluxTransformer2DModel(patch_size=1, in_channels=16, num_layers=1, num_single_layers=1,
                                         attention_head_dim=16, num_attention_heads=width // 16,
                                         joint_attention_dim=16, pooled_projection_dim=16, axes_dims_rope=(4, 4, 8),
                                         guidance_embeds=True)
    return flux_bfl_state_dict(transformer)


def _flux_transformer_of_width(width):
    """The tiny Flux run with its transformer replaced by one ``width`` wide."""
    def make(model, tmp):
        path = tmp / "flux1-dev.safetensors"
        save_file({k: v.contiguous() for k, v in _flux_transformer_state(width).items()}, path)
        return {"family": "flux", "args": ["--prompt", "a red circle", "--component", f"transformer={path}"]}

    return make


def _flux_transformer_for_wan(model, tmp):
    """The tiny Wan run with a Flux transformer file (Black Forest Labs' keys) given as its transformer."""
    path = tmp / "flux1-dev.safetensors"
    save_file({k: v.contiguous() for k, v in _flux_transformer_state(32).items()}, path)
    return {"family": "wan", "args": ["--prompt", "a red circle", "--component", f"transformer={path}"]}


def _flux_gguf(quant_type, *, width=32, cut=0):
    """The tiny Flux run with its transformer as a GGUF file (city96's layout) of ``quant_type``, ``width`` wide,
    its last ``cut`` bytes cut off."""
    def make(model, tmp):
        from memfit.testing.quantized import save_gguf

        path = save_gguf(_flux_transformer_state(width), tmp / f"flux1-dev-{quant_type}.gguf", quant_type)
        if cut:
            data = path.read_bytes()
            path.write_bytes(data[:len(data) - cut])
        return {"family": "flux", "args": ["--prompt", "a red circle", "--component", f"transformer={path}"]}

    return make


def _qwen25_vl_file(model, tmp):
    """A Qwen2.5-VL text encoder's file as ComfyUI's qwen_2.5_vl_7b.safetensors names it (a few of its tensors)."""
    path = tmp / "qwen_2.5_vl_7b.safetensors"
    names = ("model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight", "model.norm.weight",
             "visual.blocks.0.attn.qkv.weight", "visual.patch_embed.proj.weight", "lm_head.weight")
    save_file({name: torch.zeros(4, 4) for name in names}, path)
    return path


def _qwen25_vl_for_t5(model, tmp):
    return {"family": "flux", "args": ["--prompt", "a red circle", "--component",
                                       f"text_encoder_2={_qwen25_vl_file(model, tmp)}"]}


def _clip_without_projection(family):
    """The tiny ``family`` run with its text_encoder_2 (SD3's CLIP-G, SDXL's bigG) from a file in transformers' names
    without its text_projection: only SD3's CLIP-L runs with the identity there."""
    def make(model, tmp):
        from memfit.testing import build_pipeline
        from memfit.testing.single_file import _clip_state

        path = tmp / "clip_g.safetensors"
        encoder = build_pipeline(family).text_encoder_2
        save_file({k: v.contiguous() for k, v in _clip_state(encoder, projection=False).items()}, path)
        return {"family": family, "args": ["--prompt", "a red circle", "--component", f"text_encoder_2={path}"]}

    return make


# -- LoRA faults (--lora FILE[:SCALE]) ----------------------------------------------------------

def lora(make_file):
    """``--lora FILE`` with the file ``make_file(model, tmp)`` returns."""
    return lambda model, tmp: {"args": ["--prompt", "a red circle", "--lora", str(make_file(model, tmp))]}


def _flux_lora(model, tmp):
    from memfit.testing.conditioning import write_lora

    return write_lora(tmp / "flux-style.safetensors", {"transformer.transformer_blocks.0.attn.to_q": (32, 32)})


# -- parameter faults ---------------------------------------------------------------------------

def args(*extra, env=None):
    return lambda model, tmp: {"args": ["--prompt", "a red circle", *extra], "env": env or {}}


def tiny(family, *extra):
    """A run of the tiny ``family`` pipeline (memfit.testing, built once per session) with ``extra`` arguments."""
    return lambda model, tmp: {"family": family, "args": ["--prompt", "a red circle", *extra]}


def tiny_with_image(family):
    """A run of the tiny ``family`` pipeline with an input image (--image)."""
    def make(model, tmp):
        from memfit.testing.conditioning import test_image

        path = tmp / "in.png"
        test_image(32).save(path)
        return {"family": family, "args": ["--prompt", "a red circle", "--image", str(path)]}

    return make


def embeddings_of_another_text_encoder(model, tmp):
    """Embeddings the model's text encoder made, then one of its weights changed: another encoder now."""
    from memfit.models.folder import ModelFolder
    from memfit.run.embeddings import Embeddings

    Embeddings({"prompt_embeds": torch.zeros(1, 77, 32)}, "StableDiffusionPipeline",
               ModelFolder.open(model).text_fingerprint, "a red circle", None).save(tmp / "e.safetensors")
    _edit(model, "text_encoder", lambda t: t[_key(t, "final_layer_norm.weight")].add_(1))
    return {"args": ["--embeddings", str(tmp / "e.safetensors")]}


# -- output faults ------------------------------------------------------------------------------

def out_in_missing_folder(model, tmp):
    return {"out": tmp / "no-such-folder" / "out.png"}


def out_under_a_file(model, tmp):
    (tmp / "a-file").write_text("x")
    return {"out": tmp / "a-file" / "out.png"}


def out_is_a_folder(model, tmp):
    (tmp / "folder.png").mkdir()
    return {"out": tmp / "folder.png"}


def report_under_a_file(model, tmp):
    (tmp / "a-file").write_text("x")
    return {"args": ["--prompt", "a red circle", "--report", str(tmp / "a-file" / "r.json")]}


# -- cache faults -------------------------------------------------------------------------------

def cache_required_but_unusable(model, tmp):
    (tmp / "cache").write_text("a file where the cache directory goes")
    return {"args": ["--prompt", "a red circle"], "env": {"MEMFIT_CACHE_DIR": str(tmp / "cache"), "MEMFIT_CACHE": "require"}}


CASES = [
    ("no-unet-folder", no_unet, "unet is missing"),
    ("no-vae-folder", no_vae, "vae is missing"),
    ("no-unet-config", no_unet_config, "unet/config.json does not exist"),
    ("missing-tensor", missing_tensor, "has no tensor 'conv_out.weight'"),
    ("missing-text-tensor", missing_text_tensor, "final_layer_norm.weight"),
    ("extra-tensor", extra_tensor, "holds tensor 'bogus.weight'"),
    ("mixed-dtypes", mixed_dtypes, "stores tensor 'conv_in.weight' as float16"),
    ("wrong-shape", wrong_shape, "Tensor 'conv_in.weight' in"),
    ("remote-code", remote_code, "memfit never runs code from a model folder"),
    ("remote-code-auto-map", remote_code_auto_map, "memfit never runs code from a model folder"),
    ("unknown-pipeline-class", unknown_pipeline_class, "names the pipeline class 'NoSuchPipeline', which diffusers"),
    ("pickle-weights", pickle_weights, "is a pickle checkpoint"),
    ("nan-unet-weights", nan_weights("unet", "conv_out.weight"), "denoise stage produced non-finite values"),
    ("nan-text-weights", nan_weights("text_encoder", "final_layer_norm.weight"), "encode stage produced non-finite"),
    ("nan-vae-weights", nan_weights("vae", "decoder.conv_out.weight"), "decode stage produced non-finite values"),
    ("single-file-unknown-layout", single_file(_unknown_layout), "in a layout memfit does not recognise"),
    ("single-file-truncated", single_file(_truncate), "is truncated"),
    ("single-file-ckpt-without-allow-pickle", single_file(_as_ckpt), "is a pickle checkpoint"),
    ("single-file-no-configs-offline", single_file(config=False, env={"HF_HUB_OFFLINE": "1", "HF_HOME": "/nonexistent"}),
     "pass --config DIR"),
    ("single-file-transformer-alone-no-configs-offline", _mmdit_alone_offline,
     ("is a Stable Diffusion 3 checkpoint, which holds weights but no configs or tokenizers, and none were found "
      "(HF_HUB_OFFLINE is set): pass --config DIR")),
    ("single-file-config-of-another-size", _config_of_another_size, "the configs are for another model"),
    ("config-for-a-folder", args("--config", "/tmp"), "--config is for a single-file checkpoint"),
    ("refiner-config-for-a-folder", lambda model, tmp: {"args": ["--prompt", "a red circle", "--refiner", str(model),
                                                                 "--refiner-config", str(tmp)]},
     "--refiner-config is for a refiner checkpoint file"),
    ("component-unknown-name", component("vea", lambda model, tmp: _weights(model, "vae")),
     "has no component 'vea'; the components a file can replace are: "),
    ("component-file-missing", component("vae", lambda model, tmp: tmp / "no-such-vae.safetensors"),
     "no-such-vae.safetensors does not exist"),
    ("component-no-equals", args("--component", "vae"), "give NAME=FILE"),
    ("component-of-another-architecture", component("vae", lambda model, tmp: _weights(model, "unet")),
     "holds no AutoencoderKL in a layout memfit reads"),
    ("component-qwen25-vl-file-for-a-clip-encoder", component("text_encoder", _qwen25_vl_file),
     ("qwen_2.5_vl_7b.safetensors: the file holds no CLIPTextModel in a layout memfit reads (transformers "
      "('text_model.embeddings.token_embedding.weight'), OpenCLIP ('positional_embedding')); it holds 6 tensors: "
      "model.* (3), visual.* (2), lm_head.* (1). Give a text_encoder file of this model's family.")),
    ("component-qwen25-vl-file-for-a-t5-encoder", _qwen25_vl_for_t5,
     ("the file holds no T5EncoderModel in a layout memfit reads (transformers "
      "('encoder.block.0.layer.0.SelfAttention.q.weight'), llama.cpp ('enc.blk.0.attn_q.weight'))")),
    ("component-sd3-clip-g-without-projection", _clip_without_projection("sd3_single_file"),
     "clip_g.safetensors has no tensor 'text_projection.weight', which text_encoder_2 (CLIPTextModelWithProjection) needs"),
    ("component-sdxl-bigg-without-projection", _clip_without_projection("sdxl"),
     "clip_g.safetensors has no tensor 'text_projection.weight', which text_encoder_2 (CLIPTextModelWithProjection) needs"),
    ("component-vae-of-another-family", component("vae", _vae_with_latent_channels(16)),
     "has 16 latent channels where the model's has 4"),
    ("component-flux-transformer-of-another-width", _flux_transformer_of_width(64),
     "the file's FluxTransformer2DModel has width 64 where the model's has width 32 (tensor 'time_in.in_layer.weight' in "),
    ("component-wan-transformer-in-another-familys-keys", _flux_transformer_for_wan,
     "holds no WanTransformer3DModel in a layout memfit reads (Wan ('blocks.0.self_attn.q.weight'), diffusers "),
    ("gguf-type-not-read", _flux_gguf("TQ1_0"),
     "Tensor 'time_in.in_layer.weight' of "),
    ("gguf-type-not-read-lists-the-types", _flux_gguf("TQ1_0"),
     "is stored as GGUF TQ1_0, which memfit does not read; it reads F32, F16, BF16, Q2_K, Q3_K, Q4_0, Q4_1, Q4_K, Q5_0, "),
    ("gguf-truncated", _flux_gguf("Q8_0", cut=4096), "flux1-dev-Q8_0.gguf is truncated or damaged: "),
    ("gguf-of-another-width", _flux_gguf("Q8_0", width=64),
     "the file's FluxTransformer2DModel has width 64 where the model's has width 32"),
    ("quantize-unknown-type", args("--quantize", "unet=iq4_nl"),
     "--quantize unet=iq4_nl: memfit quantizes to fp8, int8, q8_0, q6_k, q5_k, q5_1, q5_0, q4_1, q4_0, q4_k, q3_k, q2_k"),
    ("quantize-unknown-component", args("--quantize", "unte=q8_0"), "has no model component 'unte'; the components"),
    ("quantize-no-equals", args("--quantize", "unet"), "--quantize unet: give NAME=TYPE"),
    ("quantize-nothing-to-quantize", lambda model, tmp: {"family": "flux", "args": [
        "--prompt", "a red circle", "--quantize", "text_encoder_2=q8_0"]},
     "text_encoder_2 (T5EncoderModel) has no linear or convolution layer whose rows are whole blocks of the type of more than "
     "1024 values outside its first and last layers"),
    ("quantize-a-quantized-file", lambda model, tmp: {**_flux_gguf("Q8_0")(model, tmp), "args": [
        *_flux_gguf("Q8_0")(model, tmp)["args"], "--quantize", "transformer=q4_0"]}, "is already quantized"),
    ("openvino-over-a-gguf-file-it-does-not-keep", lambda model, tmp: {**_flux_gguf("Q4_1")(model, tmp), "args": [
        *_flux_gguf("Q4_1")(model, tmp)["args"], "--backend", "openvino"]},
     "flux1-dev-Q4_1.gguf, and the openvino backend compiles a model of its own, which "
     "takes quantized weights stored as int8, Q4_0, Q8_0 only (--quantize transformer=int8, q4_0, q8_0). Compile the "
     "transformer with --backend inductor"),
    ("lora-file-missing", lora(lambda model, tmp: tmp / "no-such-lora.safetensors"),
     "no-such-lora.safetensors: no such file"),
    ("lora-of-another-family", lora(_flux_lora),
     "flux-style.safetensors has no weights for any module of StableDiffusionPipeline (unet, text_encoder): it is a "
     "LoRA for another model family"),
    ("seed-too-large", args("--seed", str(2**70)), "--seed"),
    ("width-huge", args("--width", "1000000"), "larger than memfit takes"),
    ("steps-huge", args("--steps", "100000000"), "more than memfit takes"),
    ("device-banana", args("--device", "banana"), "--device banana"),
    ("device-missing-gpu", args("--device", "cuda:7"), "--device cuda:7"),
    ("guidance-inf", args("--guidance", "inf"), "not a finite number"),
    ("guidance-nan", args("--guidance", "nan"), "not a finite number"),
    ("wan-beyond-its-position-table", tiny("wan", "--width", "832", "--height", "480"),
     "reaches at most 512x512 with 125 frames"),
    ("wan-image-to-video-without-an-image", tiny("wan_i2v", "--frames", "5"),
     "WanImageToVideoPipeline makes a video from an image: pass --image IMG"),
    ("wan-text-to-video-with-an-image", tiny_with_image("wan"),
     "folder makes video from text only and takes no --image (only Wan 2.2 TI2V-5B"),
    ("embeddings-of-another-text-encoder", embeddings_of_another_text_encoder, "were made by a different text encoder"),
    ("budget-garbage", args("--budget", "lots"), "lots"),
    ("threads-zero", args("--threads", "0"), "--threads 0: give at least 1 thread"),
    ("threads-not-a-number", args("--threads", "two"), "--threads two is not a whole number"),
    ("budget-above-process-too-small", args("--budget", "+1KiB"), "is below the smallest that can work for this run"),
    ("precision-garbage", args("--precision", "fp64"), "--precision"),
    ("precision-for-eager", args("--precision", "bf16"), "--precision bf16 differs from --dtype fp32"),
    ("cache-mode-garbage", args(env={"MEMFIT_CACHE": "sometimes"}), "MEMFIT_CACHE"),
    ("out-missing-folder", out_in_missing_folder, "does not exist"),
    ("out-under-a-file", out_under_a_file, "which is a file"),
    ("out-is-a-folder", out_is_a_folder, "is a folder"),
    ("report-under-a-file", report_under_a_file, "--report"),
    ("cache-require-unusable", cache_required_but_unusable, "MEMFIT_CACHE=require"),
]


def _snapshot(*roots: Path) -> dict[str, tuple[int, int]]:
    files = {}
    for root in roots:
        for path in sorted(root.rglob("*")) if root.exists() else ():
            if path.is_file():
                stat = path.stat()
                files[str(path)] = (stat.st_size, stat.st_mtime_ns)
    return files


@pytest.fixture
def bad_run(tiny_models, tmp_path, monkeypatch, capsys):
    """Run ``memfit generate`` on a damaged copy of the tiny SD model; returns (code, stderr, out)."""

    def run(make, *, command="generate"):
        model = tmp_path / "model"
        shutil.copytree(tiny_models("sd"), model)
        scratch = tmp_path / "scratch"
        scratch.mkdir()
        extra = make(model, scratch) or {}
        if isinstance(extra, list):
            extra = {"args": extra}
        for name, value in extra.get("env", {}).items():
            monkeypatch.setenv(name, value)
        out = Path(extra.get("out", scratch / "out.png"))
        args = extra.get("args", ["--prompt", "a red circle"])
        before = _snapshot(tmp_path)
        capsys.readouterr()
        run_args = RUN if command == "generate" else ["--quiet"]
        run_model = tiny_models(extra["family"]) if "family" in extra else extra.get("model", model)
        code = main([command, "--model", str(run_model), *run_args, *args, "--out", str(out)])
        err = capsys.readouterr().err
        after = _snapshot(tmp_path)
        # The store may have gained a whole, valid entry from a stage that ran before the fault was
        # found (the prompt's embeddings); never a partial one.
        cache = Path(os.environ["MEMFIT_CACHE_DIR"])
        assert not [p for p in (cache / ".tmp").glob("*")] if (cache / ".tmp").is_dir() else True
        return code, err, out, before, after

    return run


@pytest.mark.parametrize("make, expected", [case[1:] for case in CASES], ids=[case[0] for case in CASES])
def test_bad_input_is_one_sentence_exit_2_and_changes_nothing(bad_run, make, expected):
    code, err, out, before, after = bad_run(make)
    assert code == 2, err
    assert expected in err, err
    assert err.startswith("memfit: error: ") and err.strip().count("\n") == 0, err
    assert "Traceback" not in err
    assert not out.is_file()
    assert after == before, "a refused run must leave the disk as it was"


def test_a_failed_write_is_one_sentence_and_leaves_nothing(tmp_path, monkeypatch):
    """A full disk (or any write error) while saving: MemfitError naming the file, no file, no temporary."""
    from memfit.atomic import write_atomically
    from memfit.errors import MemfitError

    def full_disk(tmp):
        Path(tmp).write_bytes(b"partial")
        raise OSError(28, "No space left on device")

    with pytest.raises(MemfitError, match="out.png.*No space left"):
        write_atomically(tmp_path / "out.png", full_disk)
    assert list(tmp_path.iterdir()) == []


def test_temporaries_of_killed_writers_are_removed_by_the_next_write(tmp_path):
    import subprocess
    import sys

    from memfit.atomic import write_atomically

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    pid = int(dead.stdout)
    stale = tmp_path / f".out.png.memfit-{pid}-abc123.tmp"
    stale.write_bytes(b"")
    foreign = tmp_path / ".out.png.abc123.tmp"  # not ours: never touched
    foreign.write_bytes(b"")
    write_atomically(tmp_path / "other.png", lambda tmp: Path(tmp).write_bytes(b"png"))
    assert not stale.exists() and foreign.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == [".out.png.abc123.tmp", "other.png"]


BATCH_CASES = [
    ("jobs-file-missing", lambda model, tmp: {"args": [str(tmp / "jobs.jsonl")], "out": tmp / "out"}, "does not exist"),
    ("jobs-file-is-a-folder", lambda model, tmp: (tmp / "jobs.jsonl").mkdir() or {"args": [str(tmp / "jobs.jsonl")],
                                                                                  "out": tmp / "out"},
     "jobs.jsonl is a folder"),
]


@pytest.mark.parametrize("make, expected", [case[1:] for case in BATCH_CASES], ids=[case[0] for case in BATCH_CASES])
def test_bad_input_to_batch_is_one_sentence_exit_2_and_changes_nothing(bad_run, make, expected):
    code, err, out, before, after = bad_run(make, command="batch")
    assert code == 2, err
    assert expected in err, err
    assert err.startswith("memfit: error: ") and err.strip().count("\n") == 0, err
    assert not out.exists() and after == before


ENCODE_CASES = [
    ("missing-text-tensor", missing_text_tensor, "final_layer_norm.weight"),
    ("pickle-weights", pickle_weights, "is a pickle checkpoint"),
    ("no-text-encoder-folder", lambda model, tmp: shutil.rmtree(model / "text_encoder"), "text_encoder is missing"),
    ("nan-text-weights", nan_weights("text_encoder", "final_layer_norm.weight"), "encode stage produced non-finite"),
    ("device-banana", lambda model, tmp: {"args": ["--prompt", "x", "--device", "banana"],
                                          "out": tmp / "e.safetensors"}, "--device banana"),
    ("out-missing-folder", lambda model, tmp: {"args": ["--prompt", "x"], "out": tmp / "nope" / "e.safetensors"},
     "does not exist"),
]


@pytest.mark.parametrize("make, expected", [case[1:] for case in ENCODE_CASES], ids=[case[0] for case in ENCODE_CASES])
def test_bad_input_to_encode_is_one_sentence_exit_2_and_changes_nothing(bad_run, make, expected):
    def with_encode_out(model, tmp):
        extra = make(model, tmp) or {}
        return {"args": ["--prompt", "a red circle"], "out": tmp / "e.safetensors", **extra}

    code, err, out, before, after = bad_run(with_encode_out, command="encode")
    assert code == 2, err
    assert expected in err, err
    assert err.startswith("memfit: error: ") and err.strip().count("\n") == 0, err
    assert not out.is_file() and after == before


# -- memfit serve: flags refused before anything listens (the limits before the model is opened) -----

def serve_flags(*flags):
    # The model does not exist: a flag checked after it was opened would be refused for the model instead.
    return lambda stack, model: ["--model", "/nonexistent/model", *flags]


def _port_in_use(stack, model):
    listening = stack.enter_context(socket.create_server(("127.0.0.1", 0)))
    return ["--model", model, "--port", str(listening.getsockname()[1])]


SERVE_CASES = [
    ("serve-port-negative", serve_flags("--port", "-5"), "--port -5 is not a port; give one from 1 to 65535"),
    ("serve-port-too-large", serve_flags("--port", "70000"), "--port 70000 is not a port"),
    ("serve-port-in-use", _port_in_use, "Cannot listen on 127.0.0.1:"),
    ("serve-max-pixels-zero", serve_flags("--max-pixels", "0"), "--max-pixels 0 would refuse every request"),
    ("serve-max-prompt-chars-negative", serve_flags("--max-prompt-chars", "-1"), "--max-prompt-chars -1 would refuse"),
    ("serve-max-body-garbage", serve_flags("--max-body", "lots"), "--max-body: Cannot read 'lots' as a size"),
    ("serve-max-body-tiny", serve_flags("--max-body", "10"), "--max-body 10 would refuse every request"),
    ("serve-max-seconds-negative", serve_flags("--max-seconds", "-1"), "--max-seconds -1 must be a number of seconds"),
    ("serve-shutdown-grace-nan", serve_flags("--shutdown-grace", "nan"), "--shutdown-grace nan must be a number"),
]


@pytest.mark.parametrize("make, expected", [case[1:] for case in SERVE_CASES], ids=[case[0] for case in SERVE_CASES])
def test_bad_serve_flags_are_one_sentence_exit_2_before_the_server_starts(tiny_models, capsys, make, expected):
    with contextlib.ExitStack() as stack:
        code = main(["serve", *make(stack, tiny_models("sd"))])
    err = capsys.readouterr().err
    assert code == 2, err
    assert expected in err, err
    assert err.startswith("memfit: error: ") and err.strip().count("\n") == 0, err
