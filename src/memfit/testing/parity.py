"""The parity oracle: memfit's image must equal plain diffusers' for the same folder and settings.

`assert_matches_diffusers(model_dir, ...)` runs both and compares pixels; every later
optimisation (offload plans, backends, caches) is held to it, with `atol=0` (bitwise) where the
math is unchanged and a stated tolerance where a backend changes it.
"""

from __future__ import annotations

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


def max_pixel_difference(a, b) -> int:
    a, b = np.asarray(a, dtype=np.int16), np.asarray(b, dtype=np.int16)
    if a.shape != b.shape:
        raise AssertionError(f"image shapes differ: {a.shape} vs {b.shape}")
    return int(np.abs(a - b).max())


def assert_matches_diffusers(model_dir: str | Path, *, atol: int = 0, **settings):
    """Generate with memfit and with plain diffusers; fail if any pixel differs by more than atol."""
    from memfit.run.generate import generate

    ours = generate(model=model_dir, progress=False, **settings)
    s = ours.settings
    reference = diffusers_image(
        model_dir, prompt=s.prompt, negative_prompt=s.negative_prompt, steps=s.steps, guidance=s.guidance,
        seed=s.seed, width=s.width, height=s.height,
    )
    difference = max_pixel_difference(ours.images[0], reference)
    if difference > atol:
        raise AssertionError(f"memfit differs from plain diffusers by {difference} (allowed {atol}) for {model_dir}")
    return ours, reference
