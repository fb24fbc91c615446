"""Adapters for the diffusers pipelines memfit supports, looked up by pipeline class name."""

from __future__ import annotations

from memfit.models.families.base import DENOISE_COMPANIONS, DENOISER_NAMES, TEXT2IMG, Conditioning, PipelineAdapter, Settings, VideoFrames
from memfit.models.families.aura_flow import AuraFlowAdapter
from memfit.models.families.chroma import ChromaAdapter
from memfit.models.families.cogview4 import CogView4Adapter
from memfit.models.families.controlnet import StableDiffusionControlNetAdapter, StableDiffusionXLControlNetAdapter
from memfit.models.families.flux import FluxAdapter
from memfit.models.families.flux_fill import FluxFillAdapter
from memfit.models.families.flux_kontext import FluxKontextAdapter
from memfit.models.families.flux2 import Flux2Adapter, Flux2KleinAdapter
from memfit.models.families.hidream import HiDreamImageAdapter
from memfit.models.families.hunyuan_image import HunyuanImageAdapter
from memfit.models.families.hunyuan_video15 import HunyuanVideo15Adapter
from memfit.models.families.hunyuan_video15_i2v import HunyuanVideo15ImageToVideoAdapter
from memfit.models.families.ltx import LTXAdapter
from memfit.models.families.ltx_i2v import LTXImageToVideoAdapter
from memfit.models.families.ltx2 import LTX2Adapter
from memfit.models.families.ltx2_i2v import LTX2ImageToVideoAdapter
from memfit.models.families.pixart_sigma import PixArtSigmaAdapter
from memfit.models.families.qwenimage import QwenImageAdapter
from memfit.models.families.qwenimage_edit import QwenImageEditAdapter, QwenImageEditPlusAdapter
from memfit.models.families.sana import SanaAdapter
from memfit.models.families.sd3 import StableDiffusion3Adapter
from memfit.models.families.wan import WanAdapter
from memfit.models.families.wan_i2v import WanImageToVideoAdapter
from memfit.models.families.zimage import ZImageAdapter
from memfit.models.families.generic import GenericAdapter
from memfit.models.families.lumina2 import Lumina2Adapter
from memfit.models.families.sdxl_img2img import StableDiffusionXLImg2ImgAdapter
from memfit.models.families.stable_diffusion import StableDiffusionAdapter, StableDiffusionXLAdapter

ADAPTERS: dict[str, type[PipelineAdapter]] = {
    adapter.class_name: adapter
    for adapter in (
        StableDiffusionAdapter,
        StableDiffusionXLAdapter,
        StableDiffusionXLImg2ImgAdapter,
        StableDiffusionControlNetAdapter,
        StableDiffusionXLControlNetAdapter,
        Lumina2Adapter,
        CogView4Adapter,
        FluxAdapter,
        StableDiffusion3Adapter,
        QwenImageAdapter,
        QwenImageEditAdapter,
        QwenImageEditPlusAdapter,
        WanAdapter,
        WanImageToVideoAdapter,
        ChromaAdapter,
        SanaAdapter,
        PixArtSigmaAdapter,
        AuraFlowAdapter,
        HiDreamImageAdapter,
        ZImageAdapter,
        FluxKontextAdapter,
        FluxFillAdapter,
        Flux2Adapter,
        Flux2KleinAdapter,
        HunyuanImageAdapter,
        HunyuanVideo15Adapter,
        HunyuanVideo15ImageToVideoAdapter,
        LTXAdapter,
        LTXImageToVideoAdapter,
        LTX2Adapter,
        LTX2ImageToVideoAdapter,
    )
}


def adapter_for(class_name: str, configs: dict[str, dict], classes: dict[str, tuple[str, str]]) -> PipelineAdapter:
    """The adapter of ``class_name``; any other pipeline class gets the generic one, which plans it
    and runs its own __call__ in one stage."""
    if class_name in ADAPTERS:
        return ADAPTERS[class_name](configs, classes)
    return GenericAdapter(configs, classes, class_name)


def run_together(class_name: str, names) -> list[tuple[str, list[str]]]:
    """The components ``names`` of a live ``class_name`` pipeline, grouped by what runs together:
    [(stage, components)] with the text encoders in "encode", the denoiser(s) with a ControlNet in
    "denoise", the VAE in "decode" (the family's adapter, else the generic rule), and each other
    component (an image encoder, a safety checker) as a stage of its own. memfit.optimize plans each
    group as one stage: its members are resident together."""
    names = list(names)
    adapter = adapter_for(class_name, {}, {name: ("", "") for name in names})
    groups, placed = [], set()
    decoders = set(adapter.stage_components("decode"))
    for stage in ("encode", "denoise", "decode"):
        wanted = set(adapter.stage_components(stage)) | (set(DENOISE_COMPANIONS) if stage == "denoise" else set())
        if stage == "denoise":  # a VAE that also encodes an input image in the loop set-up (Wan I2V) groups with decode
            wanted -= decoders
        members = [name for name in names if name in wanted and name not in placed]
        if members:
            groups.append((stage, members))
            placed.update(members)
    return groups + [(name, [name]) for name in names if name not in placed]


def supporting(task: str) -> list[str]:
    """The pipeline classes whose adapter runs ``task`` (Conditioning.task), for error messages."""
    return sorted(name for name, adapter in ADAPTERS.items()
                  if task == TEXT2IMG or task in adapter.tasks) if task else sorted(ADAPTERS)


__all__ = ["ADAPTERS", "DENOISER_NAMES", "DENOISE_COMPANIONS", "TEXT2IMG", "Conditioning", "GenericAdapter",
           "PipelineAdapter", "Settings", "VideoFrames", "adapter_for", "run_together", "supporting"]
