"""LTX2Pipeline (LTX-2), text to video with audio: a Gemma-3 text encoder (Gemma3ForConditionalGeneration, its
hidden states of every layer stacked), text connectors that turn them into the video and the audio streams' text
tokens, the LTX-2 audio-video transformer, the video VAE (32x, 8x in time), the audio VAE (mel spectrograms) and a
vocoder (mel spectrograms to a waveform).

Stages: encode runs the tokenizer and Gemma-3 (encode_prompt: every prompt left-padded to 1024 tokens, with its
attention mask); denoise runs the connectors and the transformer (the pipeline's own __call__ runs the connectors
on the embeddings it is given); decode runs the video VAE, the audio VAE and the vocoder. The embeddings are the
stacked hidden states, as encode_prompt returns them: (layers + 1) x the hidden size a token (49 x 3840 for
Gemma-3 12B), large in the prompt cache, but the text encoder's own output, so memfit encode / --embeddings and
the cache hold what plain diffusers computes.

The output is a video with a soundtrack: memfit's `frames` are its frames (PIL), as `LTX2Pipeline(...).frames[0]`
with output_type="pil", and `audio` the vocoder's waveform (channels x samples, `.audio[0]`) at the vocoder's
output_sampling_rate; an .mp4 carries both (memfit.run.media). `num_frames` (Settings field, default: the
pipeline's 121) must be 8k+1 and each side a multiple of 32 (check_inputs) and of the VAE's scale times the
transformer's patch; memfit refuses other counts and sizes. Without --width/--height the video has __call__'s
default size, 768 x 512, and plays at __call__'s frame_rate, 24.

Guidance: __call__ guides the audio at audio_guidance_scale (7 by default) whatever --guidance is, so every run
has a negative pass (a negative prompt of "" without --negative-prompt), batched with the positive one as [negative,
positive]; the default spatio-temporal and modality guidance add two more transformer calls a step (batch 1).
memfit takes none of the audio or extra guidance scales yet: they are __call__'s defaults.

The denoising loop ends with both latents unpacked (output_type="latent") and denormalized with the VAEs'
latents_mean and latents_std, which live in the VAEs: the denoise stage runs the loop with those two steps left out
(the pipeline's own _denormalize_latents and _denormalize_audio_latents replaced by identities for the call, and
stand-ins holding what __call__ reads of a VAE it does not load), and the decode stage applies them with the real
statistics in __call__'s order (the audio's on its packed layout). __init__ reads the VAEs' compression ratios and
the audio's sample rate and hop length: the denoise stage sets them from the configs. The decode is __call__'s
post-loop code (decode_timestep and decode_noise_scale at their defaults: the noise for a timestep-conditioned
decoder is drawn from the run's generator, as plain diffusers draws it).

Input image (--image, the img2img task): an LTX-2 folder also makes a video from an image, its first frame, as
LTX2ImageToVideoPipeline (the same components). Its loop set-up re-compresses the image as H.264 at the CRF it reads
from its text encoder's model type (which the denoise stage does not load: call_kwargs passes the same value, read
from the config) and encodes it with the VAE's encoder (loaded and planned in the denoise stage) as the first latent
frame. Without --width/--height the video has the image's aspect ratio at the area of 768 x 512. A folder saved as
LTX2ImageToVideoPipeline is memfit.models.families.ltx2_i2v's. --lora goes into the transformer, through the
pipeline's own load_lora_weights. Prompt enhancement and the duration head (memfit always passes num_frames) are
not taken yet.
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import torch

from memfit.models.families.base import IMG2IMG, VAE_DECODE_PARTS, VideoFrames, pad_to_length
from memfit.models.families.ltx import LTXFamilyAdapter

# What the pipeline's __call__ reads of a VAE that the denoise stage does not load (see the module docstring).
# With the classes' defaults, for a config that leaves one out.
_VAE_READS = {"vae": {"scaling_factor": 1.0}, "audio_vae": {"mel_bins": 64, "latent_channels": 8}}


class LTX2Adapter(LTXFamilyAdapter):
    class_name = "LTX2Pipeline"
    takes_lora = True
    encode_components = ("tokenizer", "text_encoder")
    denoise_components = ("connectors", "transformer", "scheduler")
    decode_components = ("vae", "audio_vae", "vocoder")
    text_encoders = ("text_encoder", "tokenizer")
    unequal_lengths = "pad the shorter embedding on the left with masked zeros (attention mask 0), as Gemma's tokenizer pads"
    max_text_tokens = 1024  # __call__'s max_sequence_length
    frames_per_second = 24  # __call__'s frame_rate: the rotary positions and the audio's length follow it
    makes_audio = True
    stage_parts = {"decode": {"vae": VAE_DECODE_PARTS, "audio_vae": VAE_DECODE_PARTS},
                   "denoise": {"vae": ("encoder", "rest")}}
    tasks = {IMG2IMG: "LTX2ImageToVideoPipeline"}

    def _scaling_blocks(self):
        # AutoencoderKLLTX2Video's default scales in all four blocks; its config may state one flag for them all.
        scaling = self.configs.get("vae", {}).get("spatio_temporal_scaling", (True, True, True, True))
        return scaling if isinstance(scaling, (list, tuple)) else (scaling,) * 4

    def uses_guidance(self, guidance: float) -> bool:
        # __call__'s audio_guidance_scale (7.0; its `or` falls back to guidance_scale) guides the audio on its own.
        audio = self.call_defaults().get("audio_guidance_scale") or guidance
        return guidance > 1 or audio > 1

    def default_num_frames(self) -> int:
        # __call__'s num_frames is None: 121 where the folder has no duration head, which memfit never loads
        return 121

    def call_kwargs(self, settings):
        kwargs = super().call_kwargs(settings)
        if settings.task == IMG2IMG:
            kwargs["image_crf"] = self.image_crf()
        return kwargs

    def image_crf(self) -> int:
        """The H.264 CRF LTX2ImageToVideoPipeline re-compresses the input image at by default, which it reads from
        its text encoder's model type: the denoise stage, which does not load the text encoder, passes it."""
        from diffusers.pipelines.ltx2.utils import resolve_default_image_crf

        model_type = self.configs.get("text_encoder", {}).get("model_type")
        return resolve_default_image_crf(SimpleNamespace(config=SimpleNamespace(model_type=model_type)))

    def kept_text_elements(self, guided: bool) -> int:
        # Every layer's hidden states (output_hidden_states), then their stacked copy; under guidance the first
        # prompt's stacked embeddings stay while the second encodes.
        config = self.configs.get("text_encoder", {})
        text = config.get("text_config") or config
        per_copy = (int(text.get("num_hidden_layers", 48)) + 1) * int(text.get("hidden_size", 3840))
        return per_copy * (3 if guided else 2)

    def fit_lengths(self, pipe, embeddings, lengths):
        # Gemma's tokenizer pads on the left (the connectors read the mask that way): so does memfit.
        length = max(max(pair) for pair in lengths.values())
        padded = dict(embeddings)
        for name in ("prompt_embeds", "prompt_attention_mask", "negative_prompt_embeds", "negative_prompt_attention_mask"):
            tensor = embeddings[name]
            padded[name] = pad_to_length(tensor.flip(1), length).flip(1)
        return padded, contextlib.nullcontext()

    def denoise_call(self, pipe, embeddings, settings, generator, **inputs):
        self._set_vae_compression(pipe)
        if pipe.audio_vae is None:  # what __init__ reads from the audio VAE it does not have in this stage
            audio = self.configs.get("audio_vae", {})
            pipe.audio_sampling_rate = audio.get("sample_rate", 16000)
            pipe.audio_hop_length = audio.get("mel_hop_length", 160)
        kwargs = self.embedding_kwargs(embeddings, self.guided(settings))
        with self._latents_left_normalized(pipe):
            output = pipe(**kwargs, **self.call_kwargs(settings), **inputs, generator=generator, output_type="latent")
        return {"latents": output.frames, "audio_latents": output.audio}

    @contextlib.contextmanager
    def _latents_left_normalized(self, pipe):
        """While active, __call__'s post-loop denormalizations leave the latents as they are (the decode stage runs
        them with the VAEs' statistics, in __call__'s order), and a VAE the stage does not load is a stand-in holding
        what __call__ reads of it. The image task's VAE is loaded: its encoder normalizes the image's latents."""
        stand_ins = {}
        for name, defaults in _VAE_READS.items():
            if getattr(pipe, name, None) is not None:
                continue
            config = self.configs.get(name, {})
            channels = config.get("latent_channels", 128) if name == "vae" else config.get("base_channels", 128)
            stand_ins[name] = SimpleNamespace(config=SimpleNamespace(**{key: config.get(key, value) for key, value in defaults.items()}),
                                              latents_mean=torch.zeros(channels), latents_std=torch.ones(channels))
        unchanged = {"_denormalize_latents": lambda latents, *statistics, **scaling: latents,
                     "_denormalize_audio_latents": lambda latents, *statistics: latents}
        # object.__setattr__: neither registered as the pipeline's components (DiffusionPipeline.__setattr__ would)
        # nor left behind: the instance attributes go, the class's methods and the None components come back.
        for name, value in {**stand_ins, **unchanged}.items():
            object.__setattr__(pipe, name, value)
        try:
            yield
        finally:
            for name in unchanged:
                object.__delattr__(pipe, name)
            for name in stand_ins:
                object.__setattr__(pipe, name, None)

    def decode(self, pipe, latents, settings, generator):
        # Copied from LTX2Pipeline.__call__ after its denoising loop (output_type="pil", decode_timestep and
        # decode_noise_scale at their defaults), with the denormalizations the denoise stage's stand-ins left out.
        # Its casts to the prompt embeddings' dtype are the VAEs': memfit runs every component in one dtype.
        from diffusers.utils.torch_utils import get_module_execution_device, randn_tensor

        vae = pipe.vae
        device = get_module_execution_device(vae)
        video = latents["latents"].to(device, vae.dtype)
        timestep = None
        if vae.config.timestep_conditioning:
            noise = randn_tensor(video.shape, generator=generator, device=device, dtype=video.dtype)
            timestep = torch.tensor([0.0], device=device, dtype=video.dtype)  # decode_timestep
            noise_scale = torch.tensor([0.0], device=device, dtype=video.dtype)[:, None, None, None, None]
            video = (1 - noise_scale) * video + noise_scale * noise
        video = pipe._denormalize_latents(video, vae.latents_mean, vae.latents_std, vae.config.scaling_factor)
        video = vae.decode(video.to(vae.dtype), timestep, return_dict=False)[0]
        frames = pipe.video_processor.postprocess_video(video, output_type="pil")[0]

        audio_vae = pipe.audio_vae
        audio = latents["audio_latents"].to(get_module_execution_device(audio_vae))
        mel_bins = audio.shape[-1]
        packed = pipe._denormalize_audio_latents(pipe._pack_audio_latents(audio), audio_vae.latents_mean,
                                                 audio_vae.latents_std)
        audio = pipe._unpack_audio_latents(packed, audio.shape[2], num_mel_bins=mel_bins).to(audio_vae.dtype)
        spectrograms = audio_vae.decode(audio, return_dict=False)[0]
        waveform = pipe.vocoder(spectrograms.to(get_module_execution_device(pipe.vocoder)))
        return VideoFrames(frames, audio=waveform[0].float().cpu(),
                           sample_rate=int(pipe.vocoder.config.output_sampling_rate))
