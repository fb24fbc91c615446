"""What every pipeline adapter knows: its stages' components, its CFG rule, its encode/decode code.

Adapters hold all pipeline-specific knowledge so the staged runner stays generic. Each adapter
runs the pipeline's *own* methods (encode_prompt, __call__ with output_type="latent") and copies
only the few lines of post-processing that diffusers keeps inline after the denoising loop, so
memfit's images equal plain diffusers' bit for bit; the parity tests hold every adapter to that.
"""

from __future__ import annotations

import contextlib
import inspect
import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from memfit.errors import MemfitError
from memfit.models.limits import MAX_SIDE, check_settings

# What a text-to-image decode runs of an AutoencoderKL: the decoder, and the VAE's top-level "rest"
# block, which holds post_quant_conv (run on the latents right before the decoder) and quant_conv
# (a few KB, which comes along). The encoder half is only needed for img2img.
VAE_DECODE_PARTS = ("decoder", "rest")

# The tasks an adapter may run besides text to image (keys of PipelineAdapter.tasks); what each needs.
TEXT2IMG, IMG2IMG, INPAINT, CONTROLNET = "text2img", "img2img", "inpaint", "controlnet"
TASK_FLAGS = {IMG2IMG: "--image", INPAINT: "--mask", CONTROLNET: "--control-image",
              f"{CONTROLNET}_{IMG2IMG}": "--control-image with --image", f"{CONTROLNET}_{INPAINT}": "--control-image with --mask"}
# Components that run every denoising step beside the denoiser: planned in the denoise stage.
DENOISE_COMPANIONS = ("controlnet",)

# The names diffusers pipelines give their denoisers (Wan 2.2 has two experts: transformer, transformer_2).
DENOISER_NAMES = ("unet", "transformer", "transformer_2", "prior")


@dataclass(frozen=True)
class Settings:
    """Fully resolved generation settings (no None left): what is run and recorded in the PNG."""

    prompt: str
    negative_prompt: str | None
    steps: int
    guidance: float
    seed: int
    width: int
    height: int
    # Only for pipelines that take them (PipelineAdapter.options); the defaults mean "not used".
    true_cfg_scale: float = 1.0  # Flux: true classifier-free guidance, besides the embedded guidance
    num_frames: int = 1  # video pipelines (Wan): frames generated
    guidance_scale_2: float | None = None  # Wan 2.2: the low-noise expert's guidance (None: guidance's)
    # Beyond text-to-image (PipelineAdapter.tasks): the task run, and how far an init image is noised.
    task: str = TEXT2IMG
    strength: float | None = None  # img2img / inpaint only


@dataclass(frozen=True)
class Conditioning:
    """What a request brings besides the prompt and settings: images and adapters.

    Images are PIL images as the user gave them; the pipeline's own image processors prepare them,
    so memfit and plain diffusers see the same input. ``image`` is a list where several were given (a pipeline
    that takes several: PipelineAdapter.takes_several_images). ``controlnet`` is a ControlNet model folder;
    ``loras`` are (file, scale) pairs loaded with diffusers' load_lora_weights.
    """

    image: Any = None
    mask_image: Any = None
    control_image: Any = None
    controlnet: str | None = None
    loras: tuple[tuple[str, float], ...] = ()

    @property
    def task(self) -> str:
        """text2img, img2img or inpaint, with a "controlnet_" prefix when a ControlNet steers it
        (controlnet alone for text to image): the key of PipelineAdapter.tasks."""
        base = INPAINT if self.mask_image is not None else IMG2IMG if self.image is not None else TEXT2IMG
        if self.control_image is None:
            return base
        return CONTROLNET if base == TEXT2IMG else f"{CONTROLNET}_{base}"

    def pipeline_inputs(self) -> dict[str, Any]:
        """The images as the task pipeline's own __call__ arguments."""
        names = {"image": self.image, "mask_image": self.mask_image}
        if self.control_image is not None:
            # The ControlNet pipelines name the control image `image` when there is no init image,
            # and `control_image` beside an init image.
            names["control_image" if self.image is not None else "image"] = self.control_image
        return {name: value for name, value in names.items() if value is not None}


class VideoFrames(list):
    """A video's frames (PIL images), as a family's decode returns them, with the soundtrack its pipeline made beside
    them (LTX-2): ``audio`` a float waveform, channels x samples in [-1, 1], at ``sample_rate`` samples a second;
    None for a silent video."""

    def __init__(self, frames, audio: torch.Tensor | None = None, sample_rate: int | None = None):
        super().__init__(frames)
        self.audio = audio
        self.sample_rate = sample_rate


class PipelineAdapter:
    """Base class; one subclass per supported diffusers pipeline class."""

    class_name: ClassVar[str]
    encode_components: ClassVar[tuple[str, ...]]
    denoise_components: ClassVar[tuple[str, ...]]
    decode_components: ClassVar[tuple[str, ...]] = ("vae",)
    text_encoders: ClassVar[tuple[str, ...]]
    # How unequal positive/negative embedding lengths are handled; shown in reports and docs.
    unequal_lengths: ClassVar[str]
    # For activation estimates (memfit.plan.activations): the longest prompt the text encoders see, the
    # batch the denoiser sees under guidance, and whether the two guidance passes can be split.
    max_text_tokens: ClassVar[int] = 77
    guidance_batch: ClassVar[int] = 2
    splits_guidance: ClassVar[bool] = False
    # Whether the pipeline already runs the conditional and unconditional passes as two denoiser
    # calls (Flux's true CFG, Chroma, QwenImage): there is no batch to split, and denoise says so.
    separate_guidance_passes: ClassVar[bool] = False
    # The module paths of a component that a stage runs, where it runs only part of it (as in
    # memfit.models.archs): the plan places only these; the rest stays memory-mapped on the disk tier.
    # The VAE's encoder half runs in the denoise stage of img2img and inpaint (the init image's latents).
    stage_parts: ClassVar[dict[str, dict[str, tuple[str, ...]]]] = {"decode": {"vae": VAE_DECODE_PARTS},
                                                                     "denoise": {"vae": ("encoder", "rest")}}
    # Denoise components of which only one runs at a time, in the order they run (Wan 2.2's experts:
    # transformer for the high-noise steps, transformer_2 for the low-noise ones). The plan sizes each
    # apart (the larger, not the sum), and a run brings each in when it first runs, releasing the one
    # before (memfit.run.executor.optimize's ``phases``).
    experts: ClassVar[tuple[str, ...]] = ()
    # The optional Settings fields this pipeline takes (true_cfg_scale, num_frames, guidance_scale_2); resolve()
    # refuses the others rather than ignoring them.
    options: ClassVar[tuple[str, ...]] = ()
    # Whether memfit runs this family as separate encode, denoise and decode stages; a family
    # without an adapter of its own runs its pipeline's __call__ in one stage (GenericAdapter).
    staged: ClassVar[bool] = True
    # The prompt embeddings whose length varies with the prompt, each with its sequence dimension;
    # each has a negative_ counterpart under guidance.
    text_sequences: ClassVar[tuple[tuple[str, int], ...]] = (("prompt_embeds", 1),)
    # Frames per second a video file of this family's output plays at (video pipelines only).
    frames_per_second: ClassVar[int] = 16
    # Whether the video comes with a soundtrack made for frames_per_second (LTX-2): played at another rate, the
    # pictures would drift from the sound.
    makes_audio: ClassVar[bool] = False

    @property
    def makes_video(self) -> bool:
        return "num_frames" in self.options
    # The diffusers pipeline class that runs each task besides text to image (Conditioning.task):
    # e.g. {"img2img": "StableDiffusionImg2ImgPipeline"}. A task missing here is refused, naming its flag.
    tasks: ClassVar[dict[str, str]] = {}
    # Whether every generation needs --control-image (a ControlNet pipeline folder).
    needs_control_image: ClassVar[bool] = False
    # Whether memfit runs this family with --lora (diffusers' load_lora_weights in each stage; tested).
    takes_lora: ClassVar[bool] = False
    # Components whose config the pipeline's __init__ reads without checking that they were loaded (HunyuanVideo
    # 1.5's VAE): a stage that does not load one builds its pipeline with a weightless stand-in of its config in
    # its place, which is None again once the pipeline is built (memfit.models.folder.ModelFolder.load_stage).
    read_at_init: ClassVar[tuple[str, ...]] = ()
    # Whether the text encoders see the input image too (Qwen-Image-Edit's Qwen2.5-VL takes it through its
    # processor): the encode stage then needs --image, passes it to encode(..., image=), and its embeddings
    # and their prompt-cache key depend on the image's content.
    prompt_sees_image: ClassVar[bool] = False
    # Whether every run needs --image (an edit or image-to-video pipeline; with --mask where its one task is
    # inpaint): the run is always that task (image_task), so a plan places in the denoise stage what that task
    # loads there, and a request without the image is refused (refuse_missing_image).
    needs_image: ClassVar[bool] = False
    # Whether the pipeline takes several input images (QwenImageEditPlusPipeline takes a list): --image repeated.
    takes_several_images: ClassVar[bool] = False

    def __init__(self, configs: dict[str, dict], classes: dict[str, tuple[str, str]] | None = None):
        # Component configs read from the model folder (or a built-in architecture), and each
        # component's (library, class) from model_index.json: enough to resolve defaults, shapes
        # and plans without loading a single weight.
        self.configs = configs
        self.classes = dict(classes or {})
        # component -> (dtype name -> memfit.plan.meta.ComponentSize), for a component whose weights are not
        # sized by its config (stored quantized: memfit.quant); the planner measures the rest from configs.
        self.measured_sizes: dict = {}
        # The pipeline's own settings in model_index.json besides its components (e.g. FLUX.2 klein's
        # is_distilled); set by the model folder, empty for a built-in architecture.
        self.pipeline_options: dict = {}

    def stage_components(self, stage: str) -> tuple[str, ...]:
        """The components a stage of a text-to-image run loads (those the folder has)."""
        names = {"encode": self.encode_components, "denoise": self.denoise_components,
                 "decode": self.decode_components}.get(stage)
        if names is None:
            raise MemfitError(f"Unknown stage {stage!r}; memfit's stages are encode, denoise and decode.")
        if stage == "denoise" and self.needs_image:
            return self.task_denoise_components(self.image_task)
        return names

    @property
    def image_task(self) -> str:
        """The task every run of a family that needs_image is: inpaint where it takes a mask, else img2img."""
        return INPAINT if INPAINT in self.tasks else IMG2IMG

    def refuse_missing_image(self, conditioning: Conditioning) -> None:
        """Refuse a request without the --image (and --mask) a family that needs_image runs on every time."""
        if not self.needs_image:
            return
        if self.image_task == INPAINT:
            if conditioning.image is None or conditioning.mask_image is None:
                raise MemfitError(f"{self.class_name} fills the masked part of an image: pass --image IMG and --mask "
                                  "MASK, white where it repaints (memfit.generate(..., image=..., mask=...)).")
        elif conditioning.image is None:
            what, hint = ("makes a video from an image", "its first frame; ") if self.makes_video else ("edits an image", "")
            raise MemfitError(f"{self.class_name} {what}: pass --image IMG ({hint}memfit.generate(..., image=...)).")

    def pipeline_class(self, task: str = TEXT2IMG) -> str:
        """The diffusers pipeline class the denoise stage of ``task`` loads the folder as."""
        if task == TEXT2IMG:
            return self.class_name
        if task not in self.tasks:
            raise MemfitError(f"{self.class_name} does not take {TASK_FLAGS.get(task, task)} yet.")
        return self.tasks[task]

    def task_denoise_components(self, task: str = TEXT2IMG) -> tuple[str, ...]:
        """The denoise stage's components for ``task``: the VAE comes along where the pipeline encodes
        an init image in its loop set-up (img2img, inpaint), a ControlNet where one steers every step."""
        names = tuple(self.denoise_components)
        if IMG2IMG in task or INPAINT in task:
            names += ("vae",)
        if task.startswith(CONTROLNET) and "controlnet" not in names:
            names += ("controlnet",)
        return names

    def present_experts(self, names) -> tuple[str, ...]:
        """The experts (``experts``) among ``names``, where there are two or more: else none, and the
        stage's components are planned together as any stage's."""
        from memfit.plan.planner import alternating

        return alternating(self.experts, names)

    @property
    def denoiser(self) -> str:
        """The component the denoise stage runs every step (the first one, where there are experts)."""
        return next(name for name in self.denoise_components if name in DENOISER_NAMES)

    # ---- settings ----------------------------------------------------------------------------
    def call_defaults(self) -> dict[str, Any]:
        """The defaults of the pipeline's __call__ (none for a class diffusers does not have)."""
        import diffusers

        pipeline_class = getattr(diffusers, self.class_name, None)
        if pipeline_class is None:
            return {}
        signature = inspect.signature(pipeline_class.__call__)
        return {name: p.default for name, p in signature.parameters.items()}

    def default_num_frames(self) -> int:
        """The frames a video pipeline makes without --frames: its __call__'s num_frames."""
        return int(self.call_defaults().get("num_frames") or 1)

    def vae_scale_factor(self) -> int:
        vae = self.configs.get("vae", {})
        if "scale_factor_spatial" in vae:  # video VAEs (Wan) state it
            return int(vae["scale_factor_spatial"])
        return 2 ** (len(vae.get("block_out_channels", (0, 0, 0, 0))) - 1)

    def size_multiple(self) -> int:
        return 8

    def default_size(self) -> int:
        """The image side a request without --width/--height gets: the denoiser's trained latent
        side (its config's sample_size) times the VAE's scale, as the pipelines compute it."""
        return self.configs[self.denoiser]["sample_size"] * self.vae_scale_factor()

    def uses_guidance(self, guidance: float) -> bool:
        return guidance > 1

    def guided(self, settings: Settings) -> bool:
        """Whether this request runs an unconditional (negative) pass: what the encode stage must produce."""
        return self.uses_guidance(settings.guidance)

    def context_tokens(self, settings: Settings) -> int:
        """The tokens the denoiser attends to besides the latents it draws, for activation estimates: the
        prompt's (max_text_tokens) and, in a family that conditions on an input image, that image's."""
        return self.max_text_tokens

    def kept_text_elements(self, guided: bool) -> int:
        """Elements a prompt token's encoding keeps in memory beside the text encoder's own activations, for the
        encode stage's estimate: what the pipeline's encode holds at its peak of the hidden states it returns (a
        family that stacks every layer's, LTX-2). Here: none worth counting."""
        return 0

    def latent_frames(self, settings: Settings) -> int:
        """The latent frames the denoiser sees at once (video pipelines); for activation estimates."""
        return 1

    def call_components(self, pipe, settings: Settings) -> dict[str, Any]:
        """{name: component} to run the pipeline with in place of its own, for these settings: where a
        setting lives in a component rather than a __call__ argument (HunyuanImage's guiders hold its
        guidance scale). A plain diffusers user passes the same components to from_pretrained; the parity
        oracle (memfit.testing.parity) does so too. Here: none."""
        return {}

    def call_kwargs(self, settings: Settings) -> dict[str, Any]:
        """The pipeline's __call__ arguments for these settings, embeddings and generator aside."""
        kwargs = dict(num_inference_steps=settings.steps, guidance_scale=settings.guidance, height=settings.height,
                      width=settings.width)
        if settings.task != TEXT2IMG:
            if settings.strength is not None:
                kwargs["strength"] = settings.strength
            # img2img pipelines take the init image's size: they have no height/width to pass
            taken = self.task_call_defaults(settings.task)
            kwargs = {name: value for name, value in kwargs.items() if name in taken}
        return kwargs

    def task_call_defaults(self, task: str) -> dict[str, Any]:
        """The defaults of ``task``'s pipeline __call__."""
        import diffusers

        signature = inspect.signature(getattr(diffusers, self.pipeline_class(task)).__call__)
        return {name: p.default for name, p in signature.parameters.items()}

    def drawn_size(self, image, task: str) -> tuple[int, int]:
        """(width, height) of ``task``'s output for input ``image`` without --width/--height: the image's size
        rounded down to what the pipeline's image processor takes (its VAE's scale where the pipeline takes no
        height and draws at the image's size)."""
        step = self.vae_scale_factor() if "height" not in self.task_call_defaults(task) else self.size_multiple()
        return image.width // step * step, image.height // step * step

    def takes_strength(self, task: str) -> bool:
        """Whether ``task``'s pipeline noises its input image by a strength (an editing one draws beside it)."""
        return "strength" in self.task_call_defaults(task)

    def resolve(self, prompt, negative_prompt, steps, guidance, seed, width, height, defaults=None, *,
                true_cfg_scale=None, num_frames=None, guidance_scale_2=None, conditioning: Conditioning | None = None,
                strength=None, makes_images: bool = True) -> Settings:
        """The run's settings from the caller's and the model's defaults, refusing what the pipeline cannot take.
        ``makes_images=False`` where only the prompt is encoded (memfit.encode): the size is then never used,
        so a family does not hold it to what its denoiser reaches."""
        call_defaults = self.call_defaults()
        conditioning = conditioning or Conditioning()
        if makes_images:
            self.refuse_missing_image(conditioning)
        task = conditioning.task
        task_defaults = self.task_call_defaults(task) if task != TEXT2IMG else call_defaults
        if strength is not None and conditioning.image is None:
            raise MemfitError("--strength only applies with --image IMG (img2img or inpaint); leave it out.")
        if conditioning.mask_image is not None and conditioning.image is None:
            raise MemfitError("--mask needs --image: the mask says which part of that image to repaint.")
        if conditioning.control_image is not None and conditioning.controlnet is None and "controlnet" not in self.configs:
            raise MemfitError("--control-image needs --controlnet DIR, a diffusers ControlNet model folder.")
        if conditioning.controlnet is not None and conditioning.control_image is None:
            raise MemfitError("--controlnet needs --control-image IMG, the image the ControlNet follows.")
        if task != TEXT2IMG:
            self.pipeline_class(task)  # refuses a task this family does not run
            if strength is not None and "strength" not in task_defaults:
                raise MemfitError(f"{self.pipeline_class(task)} takes no --strength: it does not noise --image but "
                                  "draws beside it; leave --strength out.")
            if conditioning.image is not None and "strength" in task_defaults:
                strength = float(strength if strength is not None else task_defaults["strength"])
                if not 0 < strength <= 1:
                    raise MemfitError(f"--strength must be in (0, 1], got {strength}.")
            # Without --width/--height the output takes the input image's size, rounded down to
            # what the pipeline's image processor takes; img2img pipelines only ever take it.
            first = conditioning.image if conditioning.image is not None else conditioning.control_image
            if isinstance(first, (list, tuple)):  # several input images: the last one's, whose aspect the pipeline takes
                first = first[-1]
            sized = self.drawn_size(first, task)
            if "height" not in task_defaults:
                if (width is not None and width != sized[0]) or (height is not None and height != sized[1]):
                    raise MemfitError(
                        f"{self.pipeline_class(task)} draws at the size of --image ({sized[0]}x{sized[1]}); "
                        "leave out --width/--height, or resize the image.")
            width = sized[0] if width is None else width
            height = sized[1] if height is None else height
        defaults = defaults or {}
        if not isinstance(prompt, str) or not prompt.strip():
            raise MemfitError("The prompt is empty: pass a description of the image, e.g. --prompt \"a red circle\".")
        steps = int(steps if steps is not None else defaults.get("steps", call_defaults.get("num_inference_steps", 50)))
        guidance = float(guidance if guidance is not None else defaults.get("guidance", call_defaults.get("guidance_scale", 1.0)))
        seed = int(seed)
        check_settings(steps=steps, guidance=guidance, seed=seed)
        size = self.default_size()
        width = int(width if width is not None else defaults.get("width", size))
        height = int(height if height is not None else defaults.get("height", size))
        multiple = self.size_multiple()
        for label, value in (("width", width), ("height", height)):
            if value > MAX_SIDE:
                raise MemfitError(
                    f"The {label} {value} is larger than memfit takes ({MAX_SIDE} pixels); use a smaller size."
                )
            if value <= 0 or value % multiple:
                lower = max(multiple, value // multiple * multiple)
                raise MemfitError(
                    f"The {label} {value} is not a positive multiple of {multiple}, which {self.class_name} needs; "
                    f"use {lower} or {lower + multiple}."
                )
        options = {}
        for name, value in (("true_cfg_scale", true_cfg_scale), ("num_frames", num_frames),
                            ("guidance_scale_2", guidance_scale_2)):
            value = value if value is not None else defaults.get(name)
            if value is None:
                continue
            if name not in self.options:
                raise MemfitError(f"{self.class_name} takes no {name}; leave it out.")
            options[name] = int(value) if name == "num_frames" else float(value)
            if not math.isfinite(options[name]):
                raise MemfitError(f"{name} {value} is not a finite number; use a scale such as 4.0.")
        if "num_frames" in self.options:
            if "num_frames" not in options:
                options["num_frames"] = self.default_num_frames()
            if options["num_frames"] < 1:
                raise MemfitError(f"num_frames must be at least 1, got {options['num_frames']}.")
        if strength is not None and int(steps * strength) < 1:
            # the pipelines run int(steps * strength) of the schedule's steps on the init image
            raise MemfitError(f"--steps {steps} with --strength {strength} runs no denoising step "
                              f"(int({steps} * {strength}) = 0); raise --steps or --strength.")
        return Settings(prompt, negative_prompt or None, steps, guidance, int(seed), width, height, **options,
                        task=task, strength=strength)

    def load_apart(self, folder, names) -> dict[str, Any]:
        """{name: component} of ``names`` that the adapter loads itself from the model folder ``folder`` (a Path),
        where diffusers' own loading cannot run here (a processor whose video half needs torchvision); the
        stage hands them to from_pretrained in place of loading them. Here: none."""
        return {}

    # ---- stages ------------------------------------------------------------------------------
    def encode(self, pipe, settings: Settings, with_negative: bool) -> dict[str, torch.Tensor]:
        """Run the text encoders; returns the keyword arguments the denoise stage passes on. An adapter whose
        prompt_sees_image takes the input image too, as ``encode(pipe, settings, with_negative, image=IMAGE)``."""
        raise NotImplementedError

    def denoise(self, pipe, embeddings: dict[str, torch.Tensor], settings: Settings, generator, split: bool = False,
                inputs: dict[str, Any] | None = None) -> torch.Tensor:
        """Run the denoising loop with precomputed embeddings; returns the final latents.

        split: run the two guidance passes one after the other (only where splits_guidance).
        Families that batch [uncond, cond] into one call (splits_guidance) run the two passes
        apart whenever the embeddings' lengths differ, since the batch cannot hold both; the others
        take unequal lengths their own way (fit_lengths).
        inputs: further __call__ arguments, passed as they are: the task pipeline's images
        (Conditioning.pipeline_inputs), the refiner's latents and start (StableDiffusionXLImg2ImgAdapter.refine).

        Families change what happens here through the hooks it calls (fit_lengths, pad_to_longest,
        split_passes, denoise_call, after_loop), never by overriding it: its arguments are the
        runner's, the same for every family.
        """
        if split and not self.splits_guidance:
            if self.separate_guidance_passes:
                raise MemfitError(f"{self.class_name} already runs its guidance passes separately; "
                                  "plan it without 'split'.")
            raise MemfitError(f"{self.class_name} cannot split its guidance passes; plan it without 'split'.")
        lengths = self.guidance_lengths(embeddings, settings)
        unequal = any(negative != positive for negative, positive in lengths.values())
        context = contextlib.nullcontext()
        if self.splits_guidance and lengths and (split or unequal):
            if getattr(pipe, "controlnet", None) is not None:
                # The ControlNet sees the same batched embeddings; cutting them per pass is not done yet.
                raise MemfitError(
                    "A ControlNet run cannot split its guidance passes yet (positive and negative prompt embeddings "
                    "of different lengths, or a budget too small for the batched pass); use prompts of one length "
                    "(memfit encode shows them) or a larger --budget.")
            embeddings, context = self.pad_to_longest(embeddings, lengths), self.split_passes(pipe, lengths)
        elif unequal:
            embeddings, context = self.fit_lengths(pipe, embeddings, lengths)
        with context:
            latents = self.denoise_call(pipe, embeddings, settings, generator, **(inputs or {}))
        return self.after_loop(pipe, latents, settings)

    def guidance_lengths(self, embeddings: dict[str, torch.Tensor], settings: Settings) -> dict[str, tuple[int, int]]:
        """{name: (negative length, positive length)} of each text sequence (text_sequences) of a
        guided run; empty without guidance or without negative embeddings."""
        if not self.guided(settings) or any(f"negative_{name}" not in embeddings for name, _ in self.text_sequences):
            return {}
        return {name: (embeddings[f"negative_{name}"].shape[dim], embeddings[name].shape[dim])
                for name, dim in self.text_sequences}

    def fit_lengths(self, pipe, embeddings: dict[str, torch.Tensor], lengths: dict[str, tuple[int, int]]):
        """(embeddings, context): how a family that does not split its guidance batch runs positive
        and negative embeddings of unequal ``lengths`` (guidance_lengths): the embeddings to pass and
        a context the pipeline call runs in. Here: as they are, for pipelines that take them natively."""
        return embeddings, contextlib.nullcontext()

    def denoise_call(self, pipe, embeddings: dict[str, torch.Tensor], settings: Settings, generator,
                     **inputs) -> torch.Tensor:
        """The pipeline's own __call__ up to the final latents (a video pipeline's: its frames' latents)."""
        kwargs = self.embedding_kwargs(embeddings, self.guided(settings))
        output = pipe(**kwargs, **self.call_kwargs(settings), **inputs, generator=generator, output_type="latent")
        return output.frames if self.makes_video else output.images

    def after_loop(self, pipe, latents: torch.Tensor, settings: Settings) -> torch.Tensor:
        """The latents the denoise stage hands over, from the pipeline's output latents: where the
        pipeline's post-loop code starts with a step that needs the denoise stage (the image size,
        a packed layout), the family does that step here. Here: the latents as they are."""
        return latents

    def pad_to_longest(self, embeddings: dict[str, torch.Tensor],
                       lengths: dict[str, tuple[int, int]]) -> dict[str, torch.Tensor]:
        """The embeddings with each text sequence and its negative padded to the longer of the two
        (``lengths``, guidance_lengths), so the pipeline's own checks and torch.cat pass; the family
        cuts each back to its true length inside the denoiser call (split_passes, fit_lengths)."""
        padded = dict(embeddings)
        for name, dim in self.text_sequences:
            for prefix in ("", "negative_"):
                padded[prefix + name] = pad_to_length(embeddings[prefix + name], max(lengths[name]), dim=dim)
        return padded

    def split_passes(self, pipe, lengths: dict[str, tuple[int, int]]):
        """A context in which the denoiser's batched [uncond, cond] call runs as two calls on the
        unpadded embeddings of ``lengths`` (guidance_lengths; families with splits_guidance)."""
        raise NotImplementedError

    def embedding_kwargs(self, embeddings: dict[str, torch.Tensor], guided: bool) -> dict[str, torch.Tensor]:
        if guided:
            missing = [name for name in embeddings_needed(embeddings, negative=True) if name not in embeddings]
            if missing:
                raise MemfitError(
                    f"Guidance needs negative prompt embeddings, but {', '.join(missing)} is missing; "
                    "re-encode with memfit encode, or pass --guidance 1 to generate without guidance."
                )
            return dict(embeddings)
        return {name: value for name, value in embeddings.items() if not name.startswith("negative_")}

    def decode(self, pipe, latents: torch.Tensor, settings: Settings, generator) -> list:
        """The images (or a video's frames) from the final latents, as the pipeline's post-loop code makes them."""
        raise NotImplementedError


def check_frame_count(num_frames: int, temporal: int, class_name: str) -> None:
    """A video VAE compresses ``temporal`` frames into one latent frame after the first: refuse a frame count that
    is not ``temporal * k + 1``, naming the two nearest that are."""
    if (num_frames - 1) % temporal:
        lower = max(1, (num_frames - 1) // temporal * temporal + 1)
        raise MemfitError(f"num_frames {num_frames} is not a multiple of {temporal} plus 1, which {class_name} needs; "
                          f"use {lower} or {lower + temporal}.")


def embeddings_needed(embeddings: dict[str, torch.Tensor], negative: bool) -> list[str]:
    """Names of the negative counterparts of the positive embeddings present."""
    positives = [name for name in embeddings if not name.startswith("negative_")]
    return [f"negative_{name}" for name in positives] if negative else positives


def paired_embeddings(with_negative: bool, **pairs: tuple[torch.Tensor, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The embeddings dict from encode_prompt's outputs, ``name=(positive, negative)``: each positive
    under its name, then, where with_negative, each negative under negative_<name>."""
    embeddings = {name: positive for name, (positive, _) in pairs.items()}
    if with_negative:
        embeddings.update({f"negative_{name}": negative for name, (_, negative) in pairs.items()})
    return embeddings


def masked_embeddings(positive, positive_mask, negative, negative_mask, with_negative: bool) -> dict[str, torch.Tensor]:
    """The embeddings dict of a pipeline whose encode_prompt returns embeddings with attention masks."""
    return paired_embeddings(with_negative, prompt_embeds=(positive, negative),
                             prompt_attention_mask=(positive_mask, negative_mask))


def pad_masked(embeddings: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Positive and negative embeddings of unequal lengths, the shorter one right-padded with zeros
    and its attention mask with zeros, so the padded tokens are masked out of attention (what a
    tokenizer's own padding does). Embeddings of equal lengths, or without a negative, come back as they are."""
    positive, negative = embeddings["prompt_embeds"], embeddings.get("negative_prompt_embeds")
    if negative is None or negative.shape[1] == positive.shape[1]:
        return embeddings
    length = max(negative.shape[1], positive.shape[1])
    padded = dict(embeddings)
    for name in ("prompt_embeds", "prompt_attention_mask", "negative_prompt_embeds", "negative_prompt_attention_mask"):
        padded[name] = pad_to_length(embeddings[name], length)
    return padded


def pad_to_length(tensor: torch.Tensor, length: int, dim: int = 1) -> torch.Tensor:
    """Right-pad `tensor` with zeros along `dim` to `length`."""
    missing = length - tensor.shape[dim]
    if missing <= 0:
        return tensor
    shape = list(tensor.shape)
    shape[dim] = missing
    return torch.cat([tensor, tensor.new_zeros(shape)], dim=dim)


@contextlib.contextmanager
def replaced_forward(module: torch.nn.Module, forward):
    """While active, ``module(...)`` runs ``forward``; afterwards the module's own forward is back,
    including an instance-level one (a compiled entry point), not just the class's."""
    instance_forward = vars(module).get("forward")
    module.forward = forward
    try:
        yield
    finally:
        if instance_forward is None:
            del module.forward
        else:
            module.forward = instance_forward


def split_transformer_passes(transformer: torch.nn.Module, negative_length: int, positive_length: int):
    """While active, a batched [uncond, cond] call of a text-conditioned transformer (SD3, AuraFlow)
    runs as two calls, each on its own row and its unpadded encoder_hidden_states.

    Arguments are matched by name against the class's forward, so a caller's positional order does
    not matter; a call whose batch is not the guidance pair of two passes through unchanged.
    """
    original_forward = transformer.forward
    signature = inspect.signature(type(transformer).forward)

    def forward(*args, **kwargs):
        bound = signature.bind(transformer, *args, **kwargs)
        if bound.arguments["hidden_states"].shape[0] != 2:
            return original_forward(*args, **kwargs)
        outputs = []
        for row, length in ((0, negative_length), (1, positive_length)):
            rows = slice(row, row + 1)
            arguments = dict(bound.arguments)
            for name, value in arguments.items():
                if name == "encoder_hidden_states":
                    arguments[name] = value[rows, :length]
                elif name in ("hidden_states", "pooled_projections") or (
                        name == "timestep" and torch.is_tensor(value) and value.ndim > 0):
                    arguments[name] = value[rows]
            if "return_dict" in signature.parameters:
                arguments["return_dict"] = False
            call = inspect.BoundArguments(signature, arguments)
            outputs.append(original_forward(*call.args[1:], **call.kwargs)[0])
        return (torch.cat(outputs),)

    return replaced_forward(transformer, forward)
