"""StableDiffusionControlNetPipeline and StableDiffusionXLControlNetPipeline folders.

A folder saved from a ControlNet pipeline holds its ControlNet as a component (``controlnet``). It
runs every denoising step beside the UNet, so it is loaded and planned in the denoise stage. The
text encoders and the VAE are the family's own, so encode and decode are SD's / SDXL's. Such a
folder always needs a control image (``--control-image``); ``--controlnet DIR`` swaps in another.
"""

from __future__ import annotations

from memfit.models.families.base import CONTROLNET
from memfit.models.families.stable_diffusion import StableDiffusionAdapter, StableDiffusionXLAdapter


class StableDiffusionControlNetAdapter(StableDiffusionAdapter):
    class_name = "StableDiffusionControlNetPipeline"
    denoise_components = ("unet", "controlnet", "scheduler")
    needs_control_image = True  # memfit generate refuses a request without one; memfit encode needs none
    tasks = {task: name for task, name in StableDiffusionAdapter.tasks.items() if task.startswith(CONTROLNET)}


class StableDiffusionXLControlNetAdapter(StableDiffusionXLAdapter):
    class_name = "StableDiffusionXLControlNetPipeline"
    denoise_components = ("unet", "controlnet", "scheduler")
    needs_control_image = True  # memfit generate refuses a request without one; memfit encode needs none
    tasks = {task: name for task, name in StableDiffusionXLAdapter.tasks.items() if task.startswith(CONTROLNET)}
