"""StableDiffusionControlNetPipeline and StableDiffusionXLControlNetPipeline folders.

A folder saved from a ControlNet pipeline holds its ControlNet as a component (``controlnet``). It
runs every denoising step beside the UNet, so it is loaded and planned in the denoise stage. The
text encoders and the VAE are the family's own, so encode and decode are SD's / SDXL's. Such a
folder always needs a control image (``--control-image``); ``--controlnet DIR`` swaps in another.
"""

from __future__ import annotations

from memfit.errors import MemfitError
from memfit.models.families.base import CONTROLNET, TEXT2IMG, Conditioning
from memfit.models.families.stable_diffusion import StableDiffusionAdapter, StableDiffusionXLAdapter


class _ControlNetFolder:
    def resolve(self, *args, conditioning: Conditioning | None = None, **kwargs):
        if conditioning is None or conditioning.control_image is None:
            raise MemfitError(f"{self.class_name} draws from a control image: pass --control-image IMG "
                              "(memfit.generate(..., control_image=...)).")
        return super().resolve(*args, conditioning=conditioning, **kwargs)

    def pipeline_class(self, task: str = TEXT2IMG) -> str:
        # Encode and decode load the folder as its own class (the ControlNet left out).
        return self.class_name if task == TEXT2IMG else super().pipeline_class(task)


class StableDiffusionControlNetAdapter(_ControlNetFolder, StableDiffusionAdapter):
    class_name = "StableDiffusionControlNetPipeline"
    denoise_components = ("unet", "controlnet", "scheduler")
    tasks = {task: name for task, name in StableDiffusionAdapter.tasks.items() if task.startswith(CONTROLNET)}


class StableDiffusionXLControlNetAdapter(_ControlNetFolder, StableDiffusionXLAdapter):
    class_name = "StableDiffusionXLControlNetPipeline"
    denoise_components = ("unet", "controlnet", "scheduler")
    tasks = {task: name for task, name in StableDiffusionXLAdapter.tasks.items() if task.startswith(CONTROLNET)}
