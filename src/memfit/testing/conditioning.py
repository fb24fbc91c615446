"""Tiny inputs beyond text to image: images, masks, ControlNets and LoRAs, all seeded, no hub.

Each builds on a tiny pipeline folder from memfit.testing.pipelines (ControlNets: kinds "sd" and
"sdxl"; LoRAs: every kind whose pipeline has a LoRA loader), and `diffusers_task_image` is the
oracle: the family's own diffusers pipeline class for the task, loaded with from_pretrained from the
same folder, LoRAs loaded with load_lora_weights.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

# The layers a tiny LoRA adapts: the denoiser's attention projections (a UNet's or a transformer's) and the
# CLIP text encoders' ones.
UNET_LORA_TARGETS = ["to_q", "to_k", "to_v", "to_out.0"]
TEXT_LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "out_proj"]
# A kohya (sd-scripts, ComfyUI) Flux LoRA's layers in a double and in a single block: its name -> the
# diffusers modules it adapts (a fused qkv is three). Single blocks' linear1 (q, k, v and the MLP fused) is left
# out: diffusers' kohya converter splits it at the real Flux width (3072), which a tiny Flux has not.
KOHYA_FLUX_DOUBLE = {"img_attn_qkv": ("attn.to_q", "attn.to_k", "attn.to_v"), "img_attn_proj": ("attn.to_out.0",),
                     "img_mlp_0": ("ff.net.0.proj",), "img_mlp_2": ("ff.net.2",), "img_mod_lin": ("norm1.linear",),
                     "txt_attn_qkv": ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"),
                     "txt_attn_proj": ("attn.to_add_out",), "txt_mlp_0": ("ff_context.net.0.proj",),
                     "txt_mlp_2": ("ff_context.net.2",), "txt_mod_lin": ("norm1_context.linear",)}
KOHYA_FLUX_SINGLE = {"linear2": ("proj_out",), "modulation_lin": ("norm.linear",)}


def test_image(size: int = 32, seed: int = 0):
    """A seeded RGB picture: smooth colour ramps plus noise, so the VAE sees structure."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    ramp = np.linspace(0, 255, size)
    pixels = np.stack([np.add.outer(ramp, ramp) / 2, np.add.outer(ramp[::-1], ramp) / 2,
                       np.full((size, size), 128.0)], axis=-1)
    pixels = np.clip(pixels + rng.normal(0, 40, pixels.shape), 0, 255).astype(np.uint8)
    return Image.fromarray(pixels, "RGB")


def test_mask(size: int = 32):
    """White (repaint) in the middle square, black (keep) around it."""
    from PIL import Image

    mask = np.zeros((size, size), dtype=np.uint8)
    mask[size // 4: 3 * size // 4, size // 4: 3 * size // 4] = 255
    return Image.fromarray(mask, "L")


def build_controlnet(model_dir: str | Path, *, seed: int = 0):
    """A ControlNet for the tiny pipeline at ``model_dir``, made from its UNet (as diffusers' from_unet
    does), its zero-initialised output convolutions given seeded random weights so that it steers."""
    from diffusers import ControlNetModel, UNet2DConditionModel

    unet = UNet2DConditionModel.from_pretrained(Path(model_dir) / "unet")
    # One stride-2 step: the tiny VAEs halve the image, so the control image meets the latents' size.
    controlnet = ControlNetModel.from_unet(unet, conditioning_embedding_out_channels=(16, 32))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in (*controlnet.controlnet_down_blocks, controlnet.controlnet_mid_block,
                       controlnet.controlnet_cond_embedding.conv_out):
            for parameter in module.parameters():
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.3)
    return controlnet.eval()


def save_controlnet(model_dir: str | Path, path: str | Path, *, seed: int = 0) -> Path:
    """build_controlnet, saved on its own in the diffusers layout (what --controlnet DIR takes)."""
    path = Path(path)
    build_controlnet(model_dir, seed=seed).save_pretrained(path, safe_serialization=True)
    return path


def save_controlnet_pipeline(model_dir: str | Path, path: str | Path, *, seed: int = 0) -> Path:
    """The tiny pipeline at ``model_dir`` with a ControlNet, saved as a ControlNet pipeline folder
    (StableDiffusionControlNetPipeline or StableDiffusionXLControlNetPipeline)."""
    import diffusers

    base = diffusers.DiffusionPipeline.from_pretrained(model_dir)
    name = {"StableDiffusionPipeline": "StableDiffusionControlNetPipeline",
            "StableDiffusionXLPipeline": "StableDiffusionXLControlNetPipeline"}[type(base).__name__]
    pipe = getattr(diffusers, name)(**base.components, controlnet=build_controlnet(model_dir, seed=seed))
    path = Path(path)
    pipe.save_pretrained(path, safe_serialization=True)
    return path


def save_lora(model_dir: str | Path, path: str | Path, *, seed: int = 0, rank: int = 4, alpha: int = 8) -> Path:
    """A seeded LoRA in diffusers' (PEFT) format for the tiny pipeline at ``model_dir``: its denoiser's attention
    projections and those of every CLIP text encoder its pipeline class loads LoRAs into, saved with the
    pipeline class's own save_lora_weights as one .safetensors file; returns the file.
    Other text encoders (T5, ...) get none: diffusers' loaders read text encoder LoRAs of CLIP only."""
    import inspect

    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    from memfit.testing.plain_diffusers import plain_pipeline

    pipe = plain_pipeline(model_dir)
    torch.manual_seed(seed)
    saves = inspect.signature(type(pipe).save_lora_weights).parameters
    layers, metadata = {}, {}
    for name in type(pipe)._lora_loadable_modules:
        module = getattr(pipe, name, None)
        if module is None or f"{name}_lora_layers" not in saves:
            continue
        denoiser = name in ("unet", "transformer")
        if not denoiser and not type(module).__name__.startswith("CLIP"):
            continue
        config = LoraConfig(r=rank, lora_alpha=alpha, init_lora_weights=False,
                            target_modules=UNET_LORA_TARGETS if denoiser else TEXT_LORA_TARGETS)
        module.add_adapter(config)
        layers[f"{name}_lora_layers"] = get_peft_model_state_dict(module)
        metadata[f"{name}_lora_adapter_metadata"] = config.to_dict()
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    type(pipe).save_lora_weights(path, **layers, **metadata, weight_name="lora.safetensors", safe_serialization=True)
    return path / "lora.safetensors"


def save_kohya_flux_lora(model_dir: str | Path, path: str | Path, *, seed: int = 0, rank: int = 4,
                         alpha: float = 2.0) -> Path:
    """A seeded LoRA in kohya's format (sd-scripts and ComfyUI: ``lora_unet_double_blocks_0_img_attn_qkv.lora_down
    .weight``, ``.lora_up.weight``, ``.alpha``; ``lora_te1_...`` for CLIP-L) for the tiny Flux pipeline at
    ``model_dir``, written to the file ``path``; the layers of KOHYA_FLUX_DOUBLE and KOHYA_FLUX_SINGLE in every
    block and CLIP-L's attention projections."""
    import diffusers
    from safetensors.torch import save_file

    pipe = diffusers.FluxPipeline.from_pretrained(model_dir)
    modules = dict(pipe.transformer.named_modules())
    layers = {}  # kohya name -> (in features, out features)
    for blocks, kohya, table in (("transformer_blocks", "double_blocks", KOHYA_FLUX_DOUBLE),
                                 ("single_transformer_blocks", "single_blocks", KOHYA_FLUX_SINGLE)):
        for index in range(len(getattr(pipe.transformer, blocks))):
            for name, targets in table.items():
                linears = [modules[f"{blocks}.{index}.{target}"] for target in targets]
                layers[f"lora_unet_{kohya}_{index}_{name}"] = (linears[0].in_features,
                                                               sum(linear.out_features for linear in linears))
    for name, module in pipe.text_encoder.named_modules():
        if name.endswith(tuple(TEXT_LORA_TARGETS)):
            layers["lora_te1_" + name.replace(".", "_")] = (module.in_features, module.out_features)
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, (features_in, features_out) in layers.items():
        tensors[f"{name}.lora_down.weight"] = torch.randn(rank, features_in, generator=generator) * 0.3
        tensors[f"{name}.lora_up.weight"] = torch.randn(features_out, rank, generator=generator) * 0.3
        tensors[f"{name}.alpha"] = torch.tensor(alpha)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, path)
    return path


def write_lora(path: str | Path, modules: dict[str, tuple[int, int]]) -> Path:
    """A LoRA file in diffusers' (PEFT) key format with a rank-4 pair (of ones) for each module path -> (in
    features, out features), e.g. {"transformer.transformer_blocks.0.attn.to_q": (32, 32)}: a LoRA of any layout."""
    from safetensors.torch import save_file

    tensors = {}
    for module, (features_in, features_out) in modules.items():
        tensors[f"{module}.lora_A.weight"] = torch.ones(4, features_in)
        tensors[f"{module}.lora_B.weight"] = torch.ones(features_out, 4)
    path = Path(path)
    save_file(tensors, path)
    return path


def diffusers_task_image(model_dir: str | Path, pipeline_class: str, *, seed: int, controlnet: str | Path | None = None,
                         loras=(), dtype: torch.dtype = torch.float32, **call_kwargs):
    """What plain diffusers draws: ``pipeline_class`` from_pretrained(model_dir) (with the ControlNet
    folder, if any), each LoRA loaded with load_lora_weights and weighted with set_adapters, one
    __call__ with ``call_kwargs`` and a seeded CPU generator."""
    import diffusers

    from memfit.models.folder import dtype_keyword

    extra = {}
    if controlnet is not None:
        extra["controlnet"] = diffusers.ControlNetModel.from_pretrained(controlnet, **{dtype_keyword(): dtype})
    pipe = getattr(diffusers, pipeline_class).from_pretrained(model_dir, **{dtype_keyword(): dtype}, **extra)
    pipe.set_progress_bar_config(disable=True)
    load_loras_as_diffusers(pipe, loras)
    return pipe(**call_kwargs, generator=torch.Generator(device="cpu").manual_seed(seed)).images[0]


def load_loras_as_diffusers(pipe, loras) -> None:
    """Each (file, scale) of ``loras`` loaded into ``pipe`` with load_lora_weights and weighted with set_adapters,
    as a diffusers user does."""
    names = []
    for index, (file, scale) in enumerate(loras):
        file = Path(file)
        pipe.load_lora_weights(str(file.parent), weight_name=file.name, adapter_name=f"lora{index}")
        names.append(f"lora{index}")
    if names:
        pipe.set_adapters(names, adapter_weights=[scale for _, scale in loras])
