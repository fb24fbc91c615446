"""Adapters for the diffusers pipelines memfit supports, looked up by pipeline class name."""

from __future__ import annotations

from ..errors import MemfitError
from .aura_flow import AuraFlowAdapter
from .base import PipelineAdapter, Settings
from .chroma import ChromaAdapter
from .cogview4 import CogView4Adapter
from .flux import FluxAdapter
from .hidream import HiDreamImageAdapter
from .lumina2 import Lumina2Adapter
from .pixart_sigma import PixArtSigmaAdapter
from .qwenimage import QwenImageAdapter
from .sana import SanaAdapter
from .sd3 import StableDiffusion3Adapter
from .wan import WanAdapter
from .sdxl_img2img import StableDiffusionXLImg2ImgAdapter
from .stable_diffusion import StableDiffusionAdapter, StableDiffusionXLAdapter

ADAPTERS: dict[str, type[PipelineAdapter]] = {
    adapter.class_name: adapter
    for adapter in (
        StableDiffusionAdapter,
        StableDiffusionXLAdapter,
        StableDiffusionXLImg2ImgAdapter,
        Lumina2Adapter,
        CogView4Adapter,
        FluxAdapter,
        StableDiffusion3Adapter,
        QwenImageAdapter,
        WanAdapter,
        ChromaAdapter,
        SanaAdapter,
        PixArtSigmaAdapter,
        AuraFlowAdapter,
        HiDreamImageAdapter,
    )
}


def adapter_for(class_name: str, configs: dict[str, dict], where: str = "") -> PipelineAdapter:
    if class_name not in ADAPTERS:
        raise MemfitError(
            f"{where}names pipeline class {class_name!r}, which memfit does not support yet; "
            f"supported: {', '.join(sorted(ADAPTERS))}."
        )
    return ADAPTERS[class_name](configs)


__all__ = ["ADAPTERS", "PipelineAdapter", "Settings", "adapter_for"]
