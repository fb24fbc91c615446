"""Tiny inputs beyond text to image: images, masks, ControlNets and LoRAs, all seeded, no hub.

Each builds on a tiny pipeline folder from memfit.testing.pipelines (kinds "sd" and "sdxl"), and
`diffusers_task_image` is the oracle: the family's own diffusers pipeline class for the task,
loaded with from_pretrained from the same folder, LoRAs loaded with load_lora_weights.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

# The layers a tiny LoRA adapts: the UNet's attention projections and the CLIP text encoders' ones.
UNET_LORA_TARGETS = ["to_q", "to_k", "to_v", "to_out.0"]
TEXT_LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "out_proj"]


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
    """A seeded LoRA for the tiny pipeline at ``model_dir`` (UNet and every CLIP text encoder), saved
    with the pipeline class's own save_lora_weights as one .safetensors file; returns the file."""
    import diffusers
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    pipe = diffusers.DiffusionPipeline.from_pretrained(model_dir)
    torch.manual_seed(seed)
    layers, metadata = {}, {}
    for name in ("unet", "text_encoder", "text_encoder_2"):
        module = getattr(pipe, name, None)
        if module is None:
            continue
        config = LoraConfig(r=rank, lora_alpha=alpha, init_lora_weights=False,
                            target_modules=UNET_LORA_TARGETS if name == "unet" else TEXT_LORA_TARGETS)
        module.add_adapter(config)
        layers[f"{name}_lora_layers"] = get_peft_model_state_dict(module)
        metadata[f"{name}_lora_adapter_metadata"] = config.to_dict()
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    type(pipe).save_lora_weights(path, **layers, **metadata, weight_name="lora.safetensors", safe_serialization=True)
    return path / "lora.safetensors"


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
    names = []
    for index, (file, scale) in enumerate(loras):
        file = Path(file)
        pipe.load_lora_weights(str(file.parent), weight_name=file.name, adapter_name=f"lora{index}")
        names.append(f"lora{index}")
    if names:
        pipe.set_adapters(names, adapter_weights=[scale for _, scale in loras])
    return pipe(**call_kwargs, generator=torch.Generator(device="cpu").manual_seed(seed)).images[0]
