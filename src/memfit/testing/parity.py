"""The parity oracle: memfit's image must equal plain diffusers' for the same folder and settings.

`assert_matches_diffusers(model_dir, ...)` runs both and compares pixels; every later
optimisation (offload plans, backends, caches) is held to it, with `atol=0` (bitwise) where the
math is unchanged and a stated tolerance where a backend changes it.
"""

from __future__ import annotations

import inspect
from pathlib import Path

import numpy as np
import torch


def diffusers_image(model_dir: str | Path, *, prompt: str, negative_prompt=None, steps: int, guidance: float,
                    seed: int, width: int, height: int, dtype: torch.dtype = torch.float32, **call_kwargs):
    """The image plain diffusers makes: from_pretrained, then one __call__ with a seeded CPU generator."""
    import diffusers

    pipe = diffusers.DiffusionPipeline.from_pretrained(model_dir, torch_dtype=dtype)
    pipe.set_progress_bar_config(disable=True)
    if prompt is not None:
        call_kwargs.update(prompt=prompt, negative_prompt=negative_prompt)
    return pipe(
        num_inference_steps=steps,
        guidance_scale=guidance,
        width=width,
        height=height,
        generator=torch.Generator(device="cpu").manual_seed(seed),
        **call_kwargs,
    ).images[0]


def diffusers_output(model_dir: str | Path, settings, dtype: torch.dtype = torch.float32, loras=(),
                     components: dict | None = None, weights_in_own_memory: bool = False,
                     vae_tiling: dict | None = None, **call_kwargs) -> list:
    """What plain diffusers makes for memfit's resolved `settings`: the images (or a video's frames).

    The call arguments come from the folder's adapter (PipelineAdapter.call_kwargs), so settings
    that only some pipelines take (true_cfg_scale, num_frames) reach diffusers as memfit passes them.
    ``loras``: (file, scale) pairs loaded with load_lora_weights and weighted with set_adapters; ``components``:
    name -> model loaded elsewhere (a GGUF transformer) in place of the folder's. ``weights_in_own_memory``: run
    with every weight copied out of its mapped file, as a GPU holds them (the reference for memfit's runs on the
    fake GPU, whose device tensors are CPU memory of their own): CPU kernels may round a sum differently for a
    tensor at another address modulo a cache line (seen: one level of one pixel for a tiny Wan 2.2), so the
    mapped file's placement is not what a GPU run is compared with. ``vae_tiling``: the VAE's enable_tiling
    arguments, for a decode in diffusers' tiles.
    """
    from memfit.models.folder import ModelFolder
    from memfit.testing.conditioning import load_loras_as_diffusers
    from memfit.testing.plain_diffusers import plain_pipeline

    folder = ModelFolder.open(model_dir)
    pipe = plain_pipeline(model_dir, components, torch_dtype=dtype)
    pipe.set_progress_bar_config(disable=True)
    if weights_in_own_memory:
        for module in pipe.components.values():
            if isinstance(module, torch.nn.Module):
                for tensor in (*module.parameters(), *module.buffers()):
                    tensor.data = tensor.data.clone()
    load_loras_as_diffusers(pipe, loras)
    if vae_tiling is not None:
        pipe.vae.enable_tiling(**vae_tiling)
    adapter = folder.adapter
    for name, component in adapter.call_components(pipe, settings).items():  # a setting held by a component
        setattr(pipe, name, component)
    if settings.negative_prompt is not None:  # else the pipeline's own default, as a plain call leaves it
        if "negative_prompt" in inspect.signature(type(pipe).__call__).parameters:
            call_kwargs["negative_prompt"] = settings.negative_prompt
        else:  # a pipeline that takes a negative only as embeddings (FLUX.2 klein): its own encode_prompt's
            call_kwargs["negative_prompt_embeds"] = pipe.encode_prompt(prompt=settings.negative_prompt)[0]
    output = pipe(
        prompt=settings.prompt,
        **adapter.call_kwargs(settings),
        generator=torch.Generator(device="cpu").manual_seed(settings.seed), output_type="pil", **call_kwargs,
    )
    images = getattr(output, "images", None)
    if images is not None:
        return list(images)
    audio = getattr(output, "audio", None)
    if audio is None:
        return list(output.frames[0])
    from memfit.models.families import VideoFrames

    # a video with its soundtrack (LTX-2): the waveform at the vocoder's rate, as diffusers' example writes it
    return VideoFrames(output.frames[0], audio=audio[0].float().cpu(),
                       sample_rate=int(pipe.vocoder.config.output_sampling_rate))


def generated_output(result) -> list:
    """What a memfit.generate result drew: a video's frames, or the images (as diffusers_output returns them)."""
    return result.frames if result.frames is not None else result.images


def max_pixel_difference(a, b) -> int:
    if isinstance(a, (list, tuple)) or isinstance(b, (list, tuple)):  # video frames
        if len(a) != len(b):
            raise AssertionError(f"frame counts differ: {len(a)} vs {len(b)}")
        return max((max_pixel_difference(x, y) for x, y in zip(a, b)), default=0)
    a, b = np.asarray(a, dtype=np.int16), np.asarray(b, dtype=np.int16)
    if a.shape != b.shape:
        raise AssertionError(f"image shapes differ: {a.shape} vs {b.shape}")
    return int(np.abs(a - b).max())


def assert_matches_diffusers(model_dir: str | Path, *, atol: int = 0, **settings):
    """Generate with memfit and with plain diffusers; fail if any pixel differs by more than atol, or, for a video
    with a soundtrack, if a sample of its waveform differs at all or its sample rate does.

    An ``image`` (a PIL image) reaches both: memfit.generate's --image, and the folder's own pipeline's
    ``image`` argument (a pipeline that takes it itself, as FluxKontextPipeline does); so does a ``mask``, as the
    pipeline's ``mask_image`` (FluxFillPipeline)."""
    from memfit.run.generate import generate

    ours = generate(model=model_dir, progress=False, **settings)
    s = ours.settings
    inputs = {name: settings[key] for key, name in (("image", "image"), ("mask", "mask_image"))
              if settings.get(key) is not None}
    inputs["weights_in_own_memory"] = str(settings.get("device") or "").startswith("cuda")
    if ours.frames is not None:  # a video: every frame must match
        reference = diffusers_output(model_dir, s, **inputs)
        difference = max_pixel_difference(ours.frames, reference)
        heard = getattr(reference, "audio", None)
        if (ours.audio is None) != (heard is None):
            raise AssertionError(f"memfit's video {'has' if ours.audio is not None else 'lacks'} a soundtrack, plain "
                                 f"diffusers' {'has' if heard is not None else 'lacks'} one, for {model_dir}")
        if heard is not None and (ours.audio_sample_rate != reference.sample_rate or not torch.equal(ours.audio, heard)):
            raise AssertionError(f"memfit's soundtrack differs from plain diffusers' for {model_dir}")
    else:
        reference = diffusers_output(model_dir, s, **inputs)[0]
        difference = max_pixel_difference(ours.images[0], reference)
    if difference > atol:
        raise AssertionError(f"memfit differs from plain diffusers by {difference} (allowed {atol}) for {model_dir}")
    return ours, reference
