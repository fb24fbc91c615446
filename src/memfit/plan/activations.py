"""Activation memory of each stage, and the exact strategies memfit uses when it would not fit.

Estimates come from memfit.plan.meta.activation_estimate: a shape model of each kind of component
times a factor calibrated on real-size runs (benchmarks/calibrate_activations.py, results in
docs/activation_calibration.md).

Strategies, first = the pipeline's own way; each later one holds fewer activations at once and
computes the same image (within float rounding):

  encode   plain     text encoders as the pipeline calls them (their activations are small).
  denoise  batched   the pipeline's [uncond, cond] batch of two.
           chunked   the batched pass with a UNet's attention over chunks of query tokens
                     (memfit.run.chunked_attention: each chunk's softmax is over all keys, so it is
                     exact) and its feed-forward over the same chunks: the transformer blocks'
                     per-token hidden layers never exist whole. Smaller matrix multiplies cost some
                     time, so it is chosen only when the batched pass cannot be planned; it comes
                     before split, which reads every streamed weight twice per step.
           split     the two guidance passes one after the other (split_guidance_passes): half
                     the activations, but every streamed weight is read twice per step, so it is
                     chosen only when neither batched nor chunked can be planned at all. Pipelines that
                     already run the passes separately (CogView4) have only "batched", with a batch
                     of one.
  decode   plain     vae.decode as diffusers runs it.
           banded    memfit.run.banded_decode: bands of rows, GroupNorm statistics over the whole tensor
                     (half the activations at 512x512); chosen as soon as
                     the plain decode would push any VAE weight off the device.
           tiled     diffusers' own tiled decode (vae.enable_tiling) for a video VAE that decodes every
                     frame at once (memfit.plan.tiled_decode), the largest tile first. Not the untiled
                     arithmetic (tiles blend where they overlap), so chosen only where the plain decode
                     cannot be planned at all: the frames then equal diffusers' with that tiling.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from memfit.errors import MemfitError
from memfit.plan.tiled_decode import DecodeTiling, decode_tilings, tiled_activation_bytes
from memfit.text_enum import TextEnum

__all__ = ["DECODE_HEAP_SLACK", "DENOISE_HEAP_THRESHOLD", "DEVICE_ACTIVATION_MARGIN", "HEAP_SLACK_CEILING", "HEAP_SLACK_TEMPORARIES", "Strategy", "StrategyKind", "banded_decode_unsupported",
           "choose", "decode_gains_from_heap", "decode_heap_slack", "heap_slack", "stage_strategies", "vae_execution_dtype"]

# The activation estimates are calibrated on CPU RSS. On a GPU the caching allocator rounds each
# block up (512 B, and 2 MiB segments for large ones) and keeps freed blocks that do not fit the next
# request, so the same tensors take more; this margin on the activations covers that. It is not
# measured on a GPU yet (benchmarks/gpu_check.sh measures it): the CUDA context and library
# workspaces are the detection reserve's (memfit.plan.budget.device_reserve), not this margin's.
DEVICE_ACTIVATION_MARGIN = 1.25

# On the CPU the denoising loop takes its temporaries under DENOISE_HEAP_THRESHOLD (glibc's own ceiling) from
# the heap where the budget has room for it (memfit.run.stages): as fresh mappings each would fault in and zero
# its pages every step; measured, Flux-width bf16 64x64 streamed on 2 threads, a quarter of the page faults. Freed temporaries leave holes the heap keeps until the stage ends. Measured over the estimate:
# 0 (the demo UNet), 11-23 MiB (SD 1.5 fp32 256x256), 32-107 MiB (Flux-width bf16 64x64, whose widest
# temporary is 18 MiB), 120 MiB (SD 1.5 fp32 512x512, widest above 32 MiB): counted as this many of the
# widest temporary the heap serves, at most HEAP_SLACK_CEILING.
DENOISE_HEAP_THRESHOLD = 32 * 2**20
HEAP_SLACK_TEMPORARIES = 7
HEAP_SLACK_CEILING = 128 * 2**20


# The plain decode on the CPU takes its temporaries of every size from the heap where the budget has room
# (memfit.run.memory.every_temporary_from_heap): the heap then holds freed blocks beside the live ones, measured
# (SD 1.5 fp32 VAE at 512x512) up to 1.3x the decode's estimated activations beyond them; counted as this many.
DECODE_HEAP_SLACK = 1.5


def decode_heap_slack(activation_bytes: int) -> int:
    """What the plain decode's heap may hold beside its ``activation_bytes`` of live activations."""
    return int(DECODE_HEAP_SLACK * activation_bytes)


def decode_gains_from_heap(choices: list[Strategy], vae_config, dtype: str) -> bool:
    """Whether the heap was measured to speed up this plain decode (of ``choices``, the decode's strategies):
    an AutoencoderKL-style VAE (one that can be banded) decoding in fp32. Measured (fresh processes, 2 threads):
    SD 1.5 fp32 at 512x512, 13.3 s against 16.2 s; SDXL's VAE in bf16 at 1024x1024, the same tensors twice as
    large, no faster (38.3 against 36.2 s) and 1.1 GiB higher."""
    return (any(choice.name == StrategyKind.BANDED for choice in choices)
            and vae_execution_dtype(vae_config, dtype) == "fp32")


def heap_slack(widest_bytes: int) -> int:
    """What the CPU denoising loop's heap holds beyond its live activations, for a widest activation of
    ``widest_bytes`` (see HEAP_SLACK_TEMPORARIES)."""
    return min(HEAP_SLACK_TEMPORARIES * min(widest_bytes, DENOISE_HEAP_THRESHOLD), HEAP_SLACK_CEILING)


class StrategyKind(TextEnum):
    """How a stage holds its activations (see the module doc); its text is what reports and JSON show."""

    PLAIN = "plain"
    BATCHED = "batched"
    CHUNKED = "chunked"
    SPLIT = "split"
    BANDED = "banded"
    TILED = "tiled"


@dataclasses.dataclass(frozen=True)
class Strategy:
    name: StrategyKind
    activation_bytes: int
    # True when the strategy costs little (use it as soon as it keeps more weights resident);
    # False when it costs time or changes the output (use it only when nothing cheaper can be planned).
    cheap: bool = True
    tiling: DecodeTiling | None = None  # the tiles of a "tiled" decode


def stage_strategies(adapter, stage: str, settings, guided: bool, dtype: str, *,
                     heap_temporaries: bool = False) -> list[Strategy]:
    """The strategies of ``stage`` for this family (its adapter) and request, the pipeline's own first.

    ``heap_temporaries``: the denoising loop runs on the CPU, its temporaries from the heap (heap_slack counted).
    """
    from memfit.plan.meta import activation_elements, activation_estimate, dtype_bytes

    configs = adapter.configs
    size = dict(width=settings.width, height=settings.height, vae_scale=adapter.vae_scale_factor(),
                frames=adapter.latent_frames(settings))
    if stage == "encode":
        encoders = [name for name in adapter.encode_components if name.startswith("text_encoder") and name in configs]
        batch = 2 if guided else 1
        peak = max((activation_estimate("text_encoder", configs[name], batch=batch, text_tokens=adapter.max_text_tokens,
                                        dtype=dtype, **size) for name in encoders), default=0)
        kept = activation_estimate("text_output", {"elements_per_token": adapter.kept_text_elements(guided)},
                                   text_tokens=adapter.max_text_tokens, dtype=dtype, **size)
        return [Strategy(StrategyKind.PLAIN, peak + kept)]
    if stage == "denoise":
        denoiser = adapter.denoiser
        kind = "unet" if denoiser == "unet" else "transformer"
        denoiser_class = adapter.classes.get(denoiser, ("", ""))[1]

        def estimate(batch: int, kind: str = kind) -> int:
            shape = dict(text_tokens=adapter.context_tokens(settings), class_name=denoiser_class, **size)
            live = activation_estimate(kind, configs[denoiser], batch=batch, dtype=dtype, **shape)
            if not heap_temporaries:
                return live
            widest = batch * dtype_bytes(dtype) * activation_elements(kind, configs[denoiser], **shape)
            return live + heap_slack(widest)

        batch = 1 if not guided or adapter.guidance_batch == 1 else 2
        options = [Strategy(StrategyKind.BATCHED, estimate(batch))]
        if kind == "unet":
            options.append(Strategy(StrategyKind.CHUNKED, estimate(batch, "unet_chunked"), cheap=False))
        if batch == 2 and adapter.splits_guidance:
            options.append(Strategy(StrategyKind.SPLIT, estimate(1), cheap=False))
        return options
    if stage == "decode":
        vae = configs["vae"]
        vae_dtype = vae_execution_dtype(vae, dtype)
        vae_class = adapter.classes.get("vae", ("", ""))[1]
        options = [Strategy(StrategyKind.PLAIN, activation_estimate("vae_decoder", vae, dtype=vae_dtype,
                                                                    class_name=vae_class, **size))]
        if banded_decode_unsupported(adapter.classes.get("vae", ("", "AutoencoderKL"))[1], vae) is None:
            options.append(Strategy(StrategyKind.BANDED, activation_estimate("vae_decoder_banded", vae, dtype=vae_dtype, **size)))
        for tiling in decode_tilings(vae_class, vae, size["vae_scale"], settings.width, settings.height):
            tiled = tiled_activation_bytes(tiling, vae, width=settings.width, height=settings.height,
                                           frames=size["frames"], video_frames=settings.num_frames, dtype=vae_dtype)
            options.append(Strategy(StrategyKind.TILED, tiled, cheap=False, tiling=tiling))
        return options
    if stage == "pipeline":  # a pipeline's own __call__ runs its parts one after another
        parts = [part for part in ("encode", "denoise", "decode") if adapter.stage_components(part)]
        peak = max((stage_strategies(adapter, part, settings, guided, dtype)[0].activation_bytes for part in parts),
                   default=0)
        return [Strategy(StrategyKind.PLAIN, peak)]
    raise MemfitError(f"Unknown stage {stage!r}; memfit's stages are encode, denoise, decode and pipeline.")


def vae_execution_dtype(config, dtype: str) -> str:
    """The dtype a VAE really decodes in: diffusers upcasts a force_upcast VAE to fp32 in an fp16
    pipeline (fp16 overflows in its decoder), so its weights and activations are fp32-sized then."""
    return "fp32" if dtype == "fp16" and config.get("force_upcast", True) else dtype


def banded_decode_unsupported(vae_class: str, config) -> str | None:
    """None when memfit.run.banded_decode can decode this VAE (from its config alone); else why not."""
    if vae_class != "AutoencoderKL":
        return f"{vae_class} is not an AutoencoderKL"
    if any(kind != "UpDecoderBlock2D" for kind in config.get("up_block_types", ("UpDecoderBlock2D",))):
        return "its decoder has up blocks other than UpDecoderBlock2D"
    return None


def choose(options: list[Strategy], plan_for: Callable[[int], object]) -> tuple[Strategy, object]:
    """The first strategy whose plan keeps every weight resident; else the cheap bounded strategy
    that keeps the most; a costly one only when nothing before it can be planned.

    ``plan_for(activation_bytes)`` returns a Plan or raises MemfitError when nothing fits.
    """
    planned: list[tuple[Strategy, object]] = []
    last_error: MemfitError | None = None
    for option in options:
        if planned and not option.cheap:
            break  # something cheaper already fits
        try:
            plan = plan_for(option.activation_bytes)
        except MemfitError as exc:
            last_error = exc
            continue
        if _all_resident(plan):
            return option, plan
        planned.append((option, plan))
    if planned:
        return max(planned, key=lambda pair: sum(stage.resident_bytes for stage in pair[1].stages))
    raise last_error


def _all_resident(plan) -> bool:
    """Whether ``plan`` (one stage, or its phases: memfit.run.executor.optimize's ``phases``) streams nothing."""
    return all(stage.streamed_from_host_bytes == 0 and stage.streamed_from_disk_bytes == 0 for stage in plan.stages)
