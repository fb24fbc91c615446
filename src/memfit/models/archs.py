"""Built-in architectures: the configs of real pipelines, so ``memfit plan --arch sdxl`` needs no files.

Each config is what the model's config.json on the Hub holds (fields that only affect loading,
such as ``_diffusers_version`` or ``torch_dtype``, are left out). No weights are involved: meta.py
builds these on the meta device to size them. ``expected_params`` are the parameter counts
published for (or measured from the real checkpoints of) each component; a test checks that our
meta sizing agrees with them, which guards both these configs and the sizing code.

Which components each stage runs, and everything else about a family, is its adapter's
(memfit.models.families): ``Arch.adapter()`` is the adapter a model folder of that class gets.
"""

from __future__ import annotations

import dataclasses
from types import MappingProxyType
from typing import Any, Mapping

from memfit.errors import MemfitError

__all__ = ["ARCHS", "Arch", "ComponentSpec", "get_arch"]


@dataclasses.dataclass(frozen=True)
class ComponentSpec:
    """One model of a pipeline: its folder name in the pipeline, library, class and config."""

    name: str
    library: str
    class_name: str
    config: Mapping[str, Any]
    expected_params: int | None = None
    # How far our meta count may stray from expected_params: tight where the exact checkpoint
    # count is known, loose where only a rounded marketing figure ("6B") is published.
    params_tolerance: float = 0.01


@dataclasses.dataclass(frozen=True)
class Arch:
    """A real pipeline's configs: its diffusers pipeline class and its models' configs.

    Everything memfit needs to know about the family (which components each stage runs, the
    guidance batch, text length, default size) comes from the family's adapter
    (memfit.models.families), the same one a run of a model folder uses.
    """

    name: str
    description: str
    class_name: str
    components: tuple[ComponentSpec, ...]
    # The pipeline's own settings in model_index.json besides its components (Wan 2.2's boundary_ratio,
    # expand_timesteps), as a model folder's adapter gets them (PipelineAdapter.pipeline_options).
    pipeline_options: Mapping[str, Any] = dataclasses.field(default_factory=lambda: MappingProxyType({}))

    @property
    def configs(self) -> dict[str, dict]:
        return {spec.name: dict(spec.config) for spec in self.components}

    def adapter(self):
        from memfit.models.families import adapter_for

        adapter = adapter_for(self.class_name, self.configs, {spec.name: (spec.library, spec.class_name)
                                                                for spec in self.components})
        adapter.pipeline_options = dict(self.pipeline_options)
        return adapter

    def component(self, name: str) -> ComponentSpec:
        for spec in self.components:
            if spec.name == name:
                return spec
        raise MemfitError(f"Architecture {self.name!r} has no component {name!r}.")




def _frozen(d: dict) -> Mapping[str, Any]:
    return MappingProxyType(d)


# --- shared configs -------------------------------------------------------------------------------

CLIP_L_TEXT = {  # openai/clip-vit-large-patch14 text tower, as in SD 1.5 / SDXL / Flux text_encoder
    "architectures": ["CLIPTextModel"],
    "attention_dropout": 0.0,
    "bos_token_id": 0,
    "dropout": 0.0,
    "eos_token_id": 2,
    "hidden_act": "quick_gelu",
    "hidden_size": 768,
    "initializer_factor": 1.0,
    "initializer_range": 0.02,
    "intermediate_size": 3072,
    "layer_norm_eps": 1e-05,
    "max_position_embeddings": 77,
    "model_type": "clip_text_model",
    "num_attention_heads": 12,
    "num_hidden_layers": 12,
    "pad_token_id": 1,
    "projection_dim": 768,
    "vocab_size": 49408,
}

OPENCLIP_BIGG_TEXT = {  # SDXL text_encoder_2 (OpenCLIP ViT-bigG/14 text tower with projection)
    "architectures": ["CLIPTextModelWithProjection"],
    "attention_dropout": 0.0,
    "bos_token_id": 0,
    "dropout": 0.0,
    "eos_token_id": 2,
    "hidden_act": "gelu",
    "hidden_size": 1280,
    "initializer_factor": 1.0,
    "initializer_range": 0.02,
    "intermediate_size": 5120,
    "layer_norm_eps": 1e-05,
    "max_position_embeddings": 77,
    "model_type": "clip_text_model",
    "num_attention_heads": 20,
    "num_hidden_layers": 32,
    "pad_token_id": 1,
    "projection_dim": 1280,
    "vocab_size": 49408,
}

SD_VAE = {  # AutoencoderKL of SD 1.5 (SDXL's differs only in sample_size / scaling_factor)
    "act_fn": "silu",
    "block_out_channels": [128, 256, 512, 512],
    "down_block_types": ["DownEncoderBlock2D"] * 4,
    "in_channels": 3,
    "latent_channels": 4,
    "layers_per_block": 2,
    "norm_num_groups": 32,
    "out_channels": 3,
    "sample_size": 512,
    "up_block_types": ["UpDecoderBlock2D"] * 4,
}

SDXL_VAE = {**SD_VAE, "sample_size": 1024, "scaling_factor": 0.13025, "force_upcast": True}

FLUX_VAE = {  # 16-channel AutoencoderKL of Flux.1, also used by Lumina-Image 2.0
    **SD_VAE,
    "latent_channels": 16,
    "sample_size": 1024,
    "scaling_factor": 0.3611,
    "shift_factor": 0.1159,
    "use_quant_conv": False,
    "use_post_quant_conv": False,
    "mid_block_add_attention": True,
    "force_upcast": True,
}

COGVIEW_VAE = {
    **SD_VAE,
    "block_out_channels": [128, 512, 1024, 1024],
    "latent_channels": 16,
    "layers_per_block": 3,
    "mid_block_add_attention": False,
    "sample_size": 1024,
    "scaling_factor": 1.0,
    "shift_factor": 0.0,
    "use_quant_conv": False,
    "use_post_quant_conv": False,
    "force_upcast": True,
}

# Published / checkpoint parameter counts.
CLIP_L_TEXT_PARAMS = 123_060_480
SD_VAE_PARAMS = 83_653_863
FLUX_VAE_PARAMS = 83_819_683

# --- architectures ----------------------------------------------------------------------------

SD15 = Arch(
    name="sd15",
    description="Stable Diffusion 1.5 (UNet 860M, CLIP ViT-L/14 text, AutoencoderKL)",
    class_name="StableDiffusionPipeline",
    components=(
        ComponentSpec("text_encoder", "transformers", "CLIPTextModel", _frozen(CLIP_L_TEXT), CLIP_L_TEXT_PARAMS),
        ComponentSpec(
            "unet",
            "diffusers",
            "UNet2DConditionModel",
            _frozen(
                {
                    "act_fn": "silu",
                    "attention_head_dim": 8,
                    "block_out_channels": [320, 640, 1280, 1280],
                    "center_input_sample": False,
                    "cross_attention_dim": 768,
                    "down_block_types": ["CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"],
                    "downsample_padding": 1,
                    "flip_sin_to_cos": True,
                    "freq_shift": 0,
                    "in_channels": 4,
                    "layers_per_block": 2,
                    "mid_block_scale_factor": 1,
                    "norm_eps": 1e-05,
                    "norm_num_groups": 32,
                    "out_channels": 4,
                    "sample_size": 64,
                    "up_block_types": ["UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"],
                }
            ),
            859_520_964,
        ),
        ComponentSpec("vae", "diffusers", "AutoencoderKL", _frozen(SD_VAE), SD_VAE_PARAMS),
    ),
)

SDXL = Arch(
    name="sdxl",
    description="Stable Diffusion XL base 1.0 (UNet 2.6B, CLIP-L + OpenCLIP-bigG, AutoencoderKL)",
    class_name="StableDiffusionXLPipeline",
    components=(
        ComponentSpec("text_encoder", "transformers", "CLIPTextModel", _frozen(CLIP_L_TEXT), CLIP_L_TEXT_PARAMS),
        ComponentSpec(
            "text_encoder_2", "transformers", "CLIPTextModelWithProjection", _frozen(OPENCLIP_BIGG_TEXT), 694_659_840
        ),
        ComponentSpec(
            "unet",
            "diffusers",
            "UNet2DConditionModel",
            _frozen(
                {
                    "act_fn": "silu",
                    "addition_embed_type": "text_time",
                    "addition_embed_type_num_heads": 64,
                    "addition_time_embed_dim": 256,
                    "attention_head_dim": [5, 10, 20],
                    "block_out_channels": [320, 640, 1280],
                    "center_input_sample": False,
                    "cross_attention_dim": 2048,
                    "down_block_types": ["DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"],
                    "downsample_padding": 1,
                    "flip_sin_to_cos": True,
                    "freq_shift": 0,
                    "in_channels": 4,
                    "layers_per_block": 2,
                    "mid_block_scale_factor": 1,
                    "norm_eps": 1e-05,
                    "norm_num_groups": 32,
                    "num_attention_heads": None,
                    "out_channels": 4,
                    "projection_class_embeddings_input_dim": 2816,
                    "resnet_time_scale_shift": "default",
                    "sample_size": 128,
                    "transformer_layers_per_block": [1, 2, 10],
                    "up_block_types": ["CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"],
                    "use_linear_projection": True,
                }
            ),
            2_567_463_684,
        ),
        ComponentSpec("vae", "diffusers", "AutoencoderKL", _frozen(SDXL_VAE), SD_VAE_PARAMS),
    ),
)

FLUX = Arch(
    name="flux",
    description="FLUX.1 dev (MMDiT transformer 12B, CLIP-L, T5-XXL encoder, 16-channel VAE)",
    class_name="FluxPipeline",
    components=(
        ComponentSpec("text_encoder", "transformers", "CLIPTextModel", _frozen(CLIP_L_TEXT), CLIP_L_TEXT_PARAMS),
        ComponentSpec(
            "text_encoder_2",
            "transformers",
            "T5EncoderModel",
            _frozen(
                {
                    "architectures": ["T5EncoderModel"],
                    "d_ff": 10240,
                    "d_kv": 64,
                    "d_model": 4096,
                    "decoder_start_token_id": 0,
                    "dense_act_fn": "gelu_new",
                    "dropout_rate": 0.1,
                    "eos_token_id": 1,
                    "feed_forward_proj": "gated-gelu",
                    "initializer_factor": 1.0,
                    "is_encoder_decoder": True,
                    "is_gated_act": True,
                    "layer_norm_epsilon": 1e-06,
                    "model_type": "t5",
                    "num_decoder_layers": 24,
                    "num_heads": 64,
                    "num_layers": 24,
                    "output_past": True,
                    "pad_token_id": 0,
                    "relative_attention_max_distance": 128,
                    "relative_attention_num_buckets": 32,
                    "tie_word_embeddings": False,
                    "use_cache": True,
                    "vocab_size": 32128,
                }
            ),
            4_762_310_656,
        ),
        ComponentSpec(
            "transformer",
            "diffusers",
            "FluxTransformer2DModel",
            _frozen(
                {
                    "attention_head_dim": 128,
                    "axes_dims_rope": [16, 56, 56],
                    "guidance_embeds": True,
                    "in_channels": 64,
                    "joint_attention_dim": 4096,
                    "num_attention_heads": 24,
                    "num_layers": 19,
                    "num_single_layers": 38,
                    "patch_size": 1,
                    "pooled_projection_dim": 768,
                }
            ),
            11_901_408_320,
        ),
        ComponentSpec("vae", "diffusers", "AutoencoderKL", _frozen(FLUX_VAE), FLUX_VAE_PARAMS),
    ),
)

LUMINA2 = Arch(
    name="lumina2",
    description="Lumina-Image 2.0 (Lumina2 transformer 2.6B, Gemma-2 2B text encoder, Flux VAE)",
    class_name="Lumina2Pipeline",
    components=(
        ComponentSpec(
            "text_encoder",
            "transformers",
            "Gemma2Model",
            _frozen(
                {
                    "architectures": ["Gemma2Model"],
                    "attention_bias": False,
                    "attention_dropout": 0.0,
                    "attn_logit_softcapping": 50.0,
                    "bos_token_id": 2,
                    "cache_implementation": "hybrid",
                    "eos_token_id": 1,
                    "final_logit_softcapping": 30.0,
                    "head_dim": 256,
                    "hidden_act": "gelu_pytorch_tanh",
                    "hidden_activation": "gelu_pytorch_tanh",
                    "hidden_size": 2304,
                    "initializer_range": 0.02,
                    "intermediate_size": 9216,
                    "max_position_embeddings": 8192,
                    "model_type": "gemma2",
                    "num_attention_heads": 8,
                    "num_hidden_layers": 26,
                    "num_key_value_heads": 4,
                    "pad_token_id": 0,
                    "query_pre_attn_scalar": 256,
                    "rms_norm_eps": 1e-06,
                    "rope_theta": 10000.0,
                    "sliding_window": 4096,
                    "vocab_size": 256000,
                }
            ),
            2_614_341_888,  # Gemma-2 2B: 2.61B, lm_head tied to the embedding (absent in Gemma2Model)
        ),
        ComponentSpec(
            "transformer",
            "diffusers",
            "Lumina2Transformer2DModel",
            _frozen(
                {
                    "axes_dim_rope": [32, 32, 32],
                    "axes_lens": [300, 512, 512],
                    "cap_feat_dim": 2304,
                    "ffn_dim_multiplier": None,
                    "hidden_size": 2304,
                    "in_channels": 16,
                    "multiple_of": 256,
                    "norm_eps": 1e-05,
                    "num_attention_heads": 24,
                    "num_kv_heads": 8,
                    "num_layers": 26,
                    "num_refiner_layers": 2,
                    "out_channels": None,
                    "patch_size": 2,
                    "sample_size": 128,
                    "scaling_factor": 1.0,
                }
            ),
            2_600_000_000,  # published only as "2.6B"
            0.03,
        ),
        ComponentSpec("vae", "diffusers", "AutoencoderKL", _frozen(FLUX_VAE), FLUX_VAE_PARAMS),
    ),
)

COGVIEW4 = Arch(
    name="cogview4",
    description="CogView4-6B (CogView4 transformer 6B, GLM-4-9B text encoder, Flux-style VAE)",
    class_name="CogView4Pipeline",
    components=(
        ComponentSpec(
            "text_encoder",
            "transformers",
            "GlmModel",
            _frozen(
                {
                    "architectures": ["GlmModel"],
                    "attention_bias": True,
                    "attention_dropout": 0.0,
                    "eos_token_id": [151329, 151336, 151338],
                    "head_dim": 128,
                    "hidden_act": "silu",
                    "hidden_size": 4096,
                    "initializer_range": 0.02,
                    "intermediate_size": 13696,
                    "max_position_embeddings": 8192,
                    "model_type": "glm",
                    "num_attention_heads": 32,
                    "num_hidden_layers": 40,
                    "num_key_value_heads": 2,
                    "pad_token_id": 151329,
                    "partial_rotary_factor": 0.5,
                    "rms_norm_eps": 1.5625e-07,
                    "rope_theta": 10000.0,
                    "tie_word_embeddings": False,
                    "vocab_size": 151552,
                }
            ),
            # GLM-4-9B is 9.40B with its 0.62B lm_head; CogView4 loads the bare GlmModel.
            9_399_951_360 - 151_552 * 4096,
        ),
        ComponentSpec(
            "transformer",
            "diffusers",
            "CogView4Transformer2DModel",
            _frozen(
                {
                    "attention_head_dim": 128,
                    "condition_dim": 256,
                    "in_channels": 16,
                    "num_attention_heads": 32,
                    "num_layers": 28,
                    "out_channels": 16,
                    "patch_size": 2,
                    "pos_embed_max_size": 128,
                    "rope_axes_dim": [256, 256],
                    "sample_size": 128,
                    "text_embed_dim": 4096,
                    "time_embed_dim": 512,
                }
            ),
            # Published only as "6B"; the transformer itself holds about 6.4B (the name rounds down).
            6_000_000_000,
            0.08,
        ),
        # CogView3-Plus / CogView4 VAE: wider (up to 1024 channels), 3 layers per block, no
        # mid-block attention. No published parameter count to check against.
        ComponentSpec("vae", "diffusers", "AutoencoderKL", _frozen(COGVIEW_VAE), None),
    ),
)

# FLUX.1 Kontext dev: FLUX.1 dev's components and configs, run as the image-editing pipeline.
FLUX_KONTEXT = dataclasses.replace(
    FLUX, name="flux-kontext", class_name="FluxKontextPipeline",
    description="FLUX.1 Kontext dev, image editing (FLUX.1 dev's transformer 12B, CLIP-L, T5-XXL, 16-channel VAE)")

# FLUX.1 Fill dev: FLUX.1 dev's components, its transformer's input widened from 64 to 384 channels (the noisy
# latents, the masked image's latents and the mask, each packed in 2x2 patches: 64 + 64 + 256), its output Flux's 64.
FLUX_FILL = dataclasses.replace(
    FLUX, name="flux-fill", class_name="FluxFillPipeline",
    description="FLUX.1 Fill dev, inpainting and outpainting (transformer 12B with 384 input channels, CLIP-L, "
                "T5-XXL, 16-channel VAE)",
    components=tuple(
        dataclasses.replace(spec, config=_frozen(dict(spec.config, in_channels=384, out_channels=64)),
                            # FLUX.1 dev's count with x_embedder's 320 more input channels (3072 x 320 weights)
                            expected_params=spec.expected_params + 3072 * 320)
        if spec.name == "transformer" else spec
        for spec in FLUX.components))

ZIMAGE = Arch(
    name="zimage",
    description="Z-Image (Turbo) (single-stream transformer 6B, Qwen3-4B text encoder, Flux VAE)",
    class_name="ZImagePipeline",
    components=(
        ComponentSpec(
            "text_encoder",
            "transformers",
            "Qwen3Model",
            _frozen(
                {
                    "architectures": ["Qwen3ForCausalLM"],
                    "attention_bias": False,
                    "attention_dropout": 0.0,
                    "bos_token_id": 151643,
                    "eos_token_id": 151645,
                    "head_dim": 128,
                    "hidden_act": "silu",
                    "hidden_size": 2560,
                    "initializer_range": 0.02,
                    "intermediate_size": 9728,
                    "max_position_embeddings": 40960,
                    "max_window_layers": 36,
                    "model_type": "qwen3",
                    "num_attention_heads": 32,
                    "num_hidden_layers": 36,
                    "num_key_value_heads": 8,
                    "rms_norm_eps": 1e-06,
                    "rope_scaling": None,
                    "rope_theta": 1000000,
                    "sliding_window": None,
                    "tie_word_embeddings": True,
                    "use_cache": True,
                    "use_sliding_window": False,
                    "vocab_size": 151936,
                }
            ),
            4_022_468_096,  # Qwen3-4B; its lm_head is tied to the embedding (absent in Qwen3Model)
        ),
        # ZImageTransformer2DModel's defaults in diffusers are Z-Image's own configuration.
        ComponentSpec("transformer", "diffusers", "ZImageTransformer2DModel", _frozen({}), 6_000_000_000, 0.03),
        ComponentSpec("vae", "diffusers", "AutoencoderKL", _frozen(FLUX_VAE), FLUX_VAE_PARAMS),
    ),
)

# AutoencoderKLFlux2 of every FLUX.2 model (its class defaults): 32 latent channels, batch-norm statistics
# the pipelines apply to the 2x2-patchified latents by hand. No published parameter count to check against.
FLUX2_VAE = {
    "act_fn": "silu",
    "batch_norm_eps": 0.0001,
    "batch_norm_momentum": 0.1,
    "block_out_channels": [128, 256, 512, 512],
    "down_block_types": ["DownEncoderBlock2D"] * 4,
    "in_channels": 3,
    "latent_channels": 32,
    "layers_per_block": 2,
    "mid_block_add_attention": True,
    "norm_num_groups": 32,
    "out_channels": 3,
    "patch_size": [2, 2],
    "sample_size": 1024,
    "up_block_types": ["UpDecoderBlock2D"] * 4,
    "use_post_quant_conv": True,
    "use_quant_conv": True,
}

# Mistral-Small-3.x-24B (FLUX.2 dev's text encoder): a Mistral language model with a Pixtral vision tower,
# loaded whole as Mistral3ForConditionalGeneration although text-to-image runs only the language model.
MISTRAL_SMALL_3 = {
    "architectures": ["Mistral3ForConditionalGeneration"],
    "image_token_index": 10,
    "model_type": "mistral3",
    "multimodal_projector_bias": False,
    "projector_hidden_act": "gelu",
    "spatial_merge_size": 2,
    "text_config": {
        "attention_dropout": 0.0,
        "head_dim": 128,
        "hidden_act": "silu",
        "hidden_size": 5120,
        "initializer_range": 0.02,
        "intermediate_size": 32768,
        "max_position_embeddings": 131072,
        "model_type": "mistral",
        "num_attention_heads": 32,
        "num_hidden_layers": 40,
        "num_key_value_heads": 8,
        "rms_norm_eps": 1e-05,
        "rope_theta": 1000000000.0,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "use_cache": True,
        "vocab_size": 131072,
    },
    "tie_word_embeddings": False,
    "vision_config": {
        "attention_dropout": 0.0,
        "head_dim": 64,
        "hidden_act": "silu",
        "hidden_size": 1024,
        "image_size": 1540,
        "initializer_range": 0.02,
        "intermediate_size": 4096,
        "model_type": "pixtral",
        "num_attention_heads": 16,
        "num_channels": 3,
        "num_hidden_layers": 24,
        "patch_size": 14,
        "rope_theta": 10000.0,
    },
    "vision_feature_layer": -1,
}

FLUX2_DEV = Arch(
    name="flux2-dev",
    description="FLUX.2 dev (transformer 32B, Mistral-Small-3 24B text encoder, 32-channel VAE)",
    class_name="Flux2Pipeline",
    components=(
        ComponentSpec("text_encoder", "transformers", "Mistral3ForConditionalGeneration", _frozen(MISTRAL_SMALL_3),
                      24_011_361_280),
        # Flux2Transformer2DModel's defaults in diffusers are FLUX.2 dev's own configuration; published as "32B".
        ComponentSpec("transformer", "diffusers", "Flux2Transformer2DModel", _frozen({}), 32_000_000_000, 0.02),
        ComponentSpec("vae", "diffusers", "AutoencoderKLFlux2", _frozen(FLUX2_VAE), None),
    ),
)

FLUX2_KLEIN = Arch(
    name="flux2-klein",
    description="FLUX.2 klein 4B, distilled or base (transformer 4B, Qwen3-4B text encoder, 32-channel VAE)",
    class_name="Flux2KleinPipeline",
    components=(
        ComponentSpec("text_encoder", "transformers", "Qwen3ForCausalLM",
                      _frozen(dict(ZIMAGE.component("text_encoder").config)),
                      4_022_468_096),  # Qwen3-4B; its lm_head is tied to the embedding
        ComponentSpec(
            "transformer",
            "diffusers",
            "Flux2Transformer2DModel",
            _frozen(
                {
                    "num_layers": 5,
                    "num_single_layers": 20,
                    "num_attention_heads": 24,
                    "joint_attention_dim": 7680,  # Qwen3-4B's hidden layers 9, 18 and 27, stacked
                    "guidance_embeds": False,
                }
            ),
            # Published only as "4B"; the transformer itself holds about 3.9B.
            4_000_000_000,
            0.05,
        ),
        ComponentSpec("vae", "diffusers", "AutoencoderKLFlux2", _frozen(FLUX2_VAE), None),
    ),
)

# --- the video and editing families (2025-26) ----------------------------------------------------------------
# Configs are the published folders' config.json fields that differ from diffusers' defaults (the defaults of
# WanTransformer3DModel, HunyuanVideo15Transformer3DModel, LTXVideoTransformer3DModel and
# QwenImageTransformer2DModel are those models' own); the VAEs are spelled out, as the adapters read their fields.

UMT5_XXL_ENCODER = {  # google/umt5-xxl's encoder: Wan's text_encoder
    "architectures": ["UMT5EncoderModel"],
    "d_ff": 10240,
    "d_kv": 64,
    "d_model": 4096,
    "decoder_start_token_id": 0,
    "dense_act_fn": "gelu_new",
    "eos_token_id": 1,
    "feed_forward_proj": "gated-gelu",
    "is_gated_act": True,
    "layer_norm_epsilon": 1e-06,
    "model_type": "umt5",
    "num_decoder_layers": 24,
    "num_heads": 64,
    "num_layers": 24,
    "pad_token_id": 0,
    "relative_attention_max_distance": 128,
    "relative_attention_num_buckets": 32,
    "tie_word_embeddings": False,
    "vocab_size": 256384,
}
UMT5_XXL_ENCODER_PARAMS = 5_680_910_336  # the encoder half of umt5-xxl (its 11.4 GB bf16 file)

WAN21_VAE = {  # AutoencoderKLWan of Wan 2.1 and Wan 2.2 A14B (diffusers' defaults); Qwen-Image's VAE is the same
    "base_dim": 96,
    "dim_mult": [1, 2, 4, 4],
    "num_res_blocks": 2,
    "attn_scales": [],
    "temperal_downsample": [False, True, True],
    "z_dim": 16,
    "scale_factor_spatial": 8,
    "scale_factor_temporal": 4,
}
WAN21_VAE_PARAMS = 126_892_531  # Wan2.1_VAE.pth: 508 MB at fp32

WAN22_VAE = {  # Wan 2.2 TI2V-5B's high-compression VAE: 16x16 spatial, 4x temporal, 48 latent channels
    **WAN21_VAE,
    "base_dim": 160,
    "decoder_base_dim": 256,
    "z_dim": 48,
    "is_residual": True,
    "in_channels": 12,
    "out_channels": 12,
    "patch_size": 2,
    "scale_factor_spatial": 16,
    "clip_output": False,
}

WAN_14B_PARAMS = 14_000_000_000  # published as "14B" per expert (Wan 2.1 14B, each Wan 2.2 A14B expert)

WAN22_A14B = Arch(
    name="wan2.2-a14b",
    description="Wan 2.2 T2V A14B, text to video (two 14B transformer experts, one at a time; UMT5-XXL; Wan 2.1 VAE)",
    class_name="WanPipeline",
    components=(
        ComponentSpec("text_encoder", "transformers", "UMT5EncoderModel", _frozen(UMT5_XXL_ENCODER),
                      UMT5_XXL_ENCODER_PARAMS),
        ComponentSpec("transformer", "diffusers", "WanTransformer3DModel", _frozen({}), WAN_14B_PARAMS, 0.03),
        ComponentSpec("transformer_2", "diffusers", "WanTransformer3DModel", _frozen({}), WAN_14B_PARAMS, 0.03),
        ComponentSpec("vae", "diffusers", "AutoencoderKLWan", _frozen(WAN21_VAE), WAN21_VAE_PARAMS),
    ),
    pipeline_options=_frozen({"boundary_ratio": 0.875}),
)

# Wan 2.2 I2V A14B: the input image's condition latents and mask join the noise (16 + 16 + 4 input channels).
WAN22_I2V_A14B = dataclasses.replace(
    WAN22_A14B, name="wan2.2-i2v-a14b", class_name="WanImageToVideoPipeline",
    description="Wan 2.2 I2V A14B, image to video (two 14B transformer experts, one at a time; UMT5-XXL; Wan 2.1 VAE)",
    components=tuple(dataclasses.replace(spec, config=_frozen({"in_channels": 36}))
                     if spec.name.startswith("transformer") else spec for spec in WAN22_A14B.components),
    pipeline_options=_frozen({"boundary_ratio": 0.9}))

WAN22_TI2V_5B = Arch(
    name="wan2.2-ti2v-5b",
    description="Wan 2.2 TI2V-5B, text or image to video (transformer 5B, UMT5-XXL, 16x-compressing Wan 2.2 VAE)",
    class_name="WanPipeline",
    components=(
        ComponentSpec("text_encoder", "transformers", "UMT5EncoderModel", _frozen(UMT5_XXL_ENCODER),
                      UMT5_XXL_ENCODER_PARAMS),
        ComponentSpec("transformer", "diffusers", "WanTransformer3DModel",
                      _frozen({"num_attention_heads": 24, "in_channels": 48, "out_channels": 48, "ffn_dim": 14336,
                               "num_layers": 30}),
                      5_000_000_000, 0.03),  # published as "5B"
        ComponentSpec("vae", "diffusers", "AutoencoderKLWan", _frozen(WAN22_VAE),
                      704_688_668),  # Wan2.2_VAE.pth: 2.82 GB at fp32
    ),
    pipeline_options=_frozen({"expand_timesteps": True}),
)

QWEN25_7B_TEXT = {  # Qwen2.5-VL-7B's language model
    "hidden_act": "silu",
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "max_position_embeddings": 128000,
    "num_attention_heads": 28,
    "num_hidden_layers": 28,
    "num_key_value_heads": 4,
    "rms_norm_eps": 1e-06,
    "rope_scaling": {"mrope_section": [16, 24, 24], "rope_type": "default", "type": "default"},
    "rope_theta": 1000000.0,
    "vocab_size": 152064,
}

QWEN25_VL_7B = {  # Qwen/Qwen2.5-VL-7B-Instruct: Qwen-Image's and Qwen-Image-Edit's text_encoder
    "architectures": ["Qwen2_5_VLForConditionalGeneration"],
    "model_type": "qwen2_5_vl",
    "image_token_id": 151655,
    "video_token_id": 151656,
    "vision_start_token_id": 151652,
    "vision_end_token_id": 151653,
    "tie_word_embeddings": False,
    "vocab_size": 152064,
    "text_config": QWEN25_7B_TEXT,
    "vision_config": {
        "depth": 32,
        "fullatt_block_indexes": [7, 15, 23, 31],
        "hidden_act": "silu",
        "hidden_size": 1280,
        "in_chans": 3,
        "intermediate_size": 3420,
        "num_heads": 16,
        "out_hidden_size": 3584,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "tokens_per_second": 2,
        "window_size": 112,
    },
}

QWEN_IMAGE_EDIT = Arch(
    name="qwen-image-edit",
    description="Qwen-Image-Edit, image editing (transformer 20B, Qwen2.5-VL-7B seeing the image too, Wan 2.1 VAE)",
    class_name="QwenImageEditPipeline",
    components=(
        ComponentSpec("text_encoder", "transformers", "Qwen2_5_VLForConditionalGeneration", _frozen(QWEN25_VL_7B),
                      8_292_166_656),  # Qwen2.5-VL-7B-Instruct, vision tower and lm_head included
        ComponentSpec("transformer", "diffusers", "QwenImageTransformer2DModel", _frozen({}),
                      20_000_000_000, 0.03),  # published as "20B"
        ComponentSpec("vae", "diffusers", "AutoencoderKLQwenImage",
                      _frozen({key: WAN21_VAE[key] for key in ("base_dim", "dim_mult", "num_res_blocks", "attn_scales",
                                                               "temperal_downsample", "z_dim")}),
                      WAN21_VAE_PARAMS),
    ),
)

QWEN_IMAGE_EDIT_PLUS = dataclasses.replace(
    QWEN_IMAGE_EDIT, name="qwen-image-edit-plus", class_name="QwenImageEditPlusPipeline",
    description="Qwen-Image-Edit-2509 and later, image editing (Qwen-Image-Edit's components)")

# google/byt5-small's encoder (Glyph-SDXL-v2's): HunyuanImage 2.1's and HunyuanVideo 1.5's text_encoder_2
BYT5_SMALL_ENCODER = {
    "architectures": ["T5EncoderModel"],
    "d_ff": 3584,
    "d_kv": 64,
    "d_model": 1472,
    "dense_act_fn": "gelu_new",
    "eos_token_id": 1,
    "feed_forward_proj": "gated-gelu",
    "is_gated_act": True,
    "layer_norm_epsilon": 1e-06,
    "model_type": "t5",
    "num_decoder_layers": 4,
    "num_heads": 6,
    "num_layers": 12,
    "pad_token_id": 0,
    "relative_attention_max_distance": 128,
    "relative_attention_num_buckets": 32,
    "tie_word_embeddings": False,
    "vocab_size": 384,
}

QWEN_IMAGE = dataclasses.replace(
    QWEN_IMAGE_EDIT, name="qwen-image", class_name="QwenImagePipeline",
    description="Qwen-Image, text to image (transformer 20B, Qwen2.5-VL-7B, Wan 2.1 VAE)")

HUNYUAN_IMAGE21 = Arch(
    name="hunyuanimage2.1",
    description="HunyuanImage 2.1, text to image (transformer 17B, Qwen2.5-VL-7B, ByT5 for quoted text, "
                "32x-compressing VAE)",
    class_name="HunyuanImagePipeline",
    components=(
        ComponentSpec("text_encoder", "transformers", "Qwen2_5_VLForConditionalGeneration", _frozen(QWEN25_VL_7B),
                      8_292_166_656),
        ComponentSpec("text_encoder_2", "transformers", "T5EncoderModel", _frozen(BYT5_SMALL_ENCODER), None),
        # diffusers' defaults are 2.1's transformer; its glyph (ByT5) embeddings come in 1472 wide
        ComponentSpec("transformer", "diffusers", "HunyuanImageTransformer2DModel",
                      _frozen({"text_embed_2_dim": 1472}), 17_000_000_000, 0.03),  # published as "17B"
        ComponentSpec("vae", "diffusers", "AutoencoderKLHunyuanImage",
                      _frozen({"in_channels": 3, "out_channels": 3, "latent_channels": 64,
                               "block_out_channels": [128, 256, 512, 512, 1024, 1024], "layers_per_block": 2,
                               "spatial_compression_ratio": 32, "sample_size": 384, "scaling_factor": 0.75289}),
                      None),
    ),
)

HUNYUAN_VIDEO15 = Arch(
    name="hunyuanvideo1.5",
    description="HunyuanVideo 1.5, text to video (transformer 8.3B, Qwen2.5-VL-7B's language model, ByT5, "
                "16x-compressing VAE)",
    class_name="HunyuanVideo15Pipeline",
    components=(
        ComponentSpec("text_encoder", "transformers", "Qwen2_5_VLTextModel",
                      _frozen({**QWEN25_7B_TEXT, "model_type": "qwen2_5_vl_text",
                               "architectures": ["Qwen2_5_VLTextModel"]}),
                      7_070_619_136),  # Qwen2.5-7B's 7,615,616,512 less its lm_head (152064 x 3584)
        ComponentSpec(
            "text_encoder_2",
            "transformers",
            "T5EncoderModel",
            _frozen(BYT5_SMALL_ENCODER),
            None,  # published for byt5-small as a whole (300M, with its decoder) only
        ),
        ComponentSpec("transformer", "diffusers", "HunyuanVideo15Transformer3DModel",
                      _frozen({"task_type": "t2v", "target_size": 480}), 8_300_000_000, 0.01),  # published as "8.3B"
        ComponentSpec("vae", "diffusers", "AutoencoderKLHunyuanVideo15",
                      _frozen({"latent_channels": 32, "block_out_channels": [128, 256, 512, 1024, 1024],
                               "layers_per_block": 2, "spatial_compression_ratio": 16, "temporal_compression_ratio": 4,
                               "scaling_factor": 1.03682}),
                      None),
    ),
)

LTX_VIDEO = Arch(
    name="ltx-video",
    description="LTX-Video 0.9 2B, text to video (transformer 2B, T5-XXL, 32x-compressing 128-channel VAE)",
    class_name="LTXPipeline",
    components=(
        # The same T5-XXL v1.1 encoder as Flux's text_encoder_2.
        dataclasses.replace(FLUX.component("text_encoder_2"), name="text_encoder"),
        ComponentSpec("transformer", "diffusers", "LTXVideoTransformer3DModel", _frozen({}),
                      1_900_000_000, 0.02),  # published as "2B"; the transformer holds about 1.92B
        ComponentSpec("vae", "diffusers", "AutoencoderKLLTXVideo",
                      _frozen({"latent_channels": 128, "block_out_channels": [128, 256, 512, 512],
                               "patch_size": 4, "patch_size_t": 1, "scaling_factor": 1.0,
                               "spatio_temporal_scaling": [True, True, True, False]}),
                      None),
    ),
)

# Gemma-3 12B (LTX-2's text encoder), loaded whole as Gemma3ForConditionalGeneration (with its SigLIP vision tower)
# although the prompt runs only the language model, every layer's hidden states stacked (49 x 3840 a token).
GEMMA3_12B = {
    "architectures": ["Gemma3ForConditionalGeneration"],
    "boi_token_index": 255999,
    "eoi_token_index": 256000,
    "eos_token_id": [1, 106],
    "image_token_index": 262144,
    "initializer_range": 0.02,
    "mm_tokens_per_image": 256,
    "model_type": "gemma3",
    "text_config": {
        "attention_bias": False,
        "attention_dropout": 0.0,
        "attn_logit_softcapping": None,
        "final_logit_softcapping": None,
        "head_dim": 256,
        "hidden_activation": "gelu_pytorch_tanh",
        "hidden_size": 3840,
        "intermediate_size": 15360,
        "max_position_embeddings": 131072,
        "model_type": "gemma3_text",
        "num_attention_heads": 16,
        "num_hidden_layers": 48,
        "num_key_value_heads": 8,
        "query_pre_attn_scalar": 256,
        "rms_norm_eps": 1e-06,
        "rope_local_base_freq": 10000.0,
        "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
        "rope_theta": 1000000.0,
        "sliding_window": 1024,
        "vocab_size": 262208,
    },
    "vision_config": {
        "hidden_size": 1152,
        "image_size": 896,
        "intermediate_size": 4304,
        "model_type": "siglip_vision_model",
        "num_attention_heads": 16,
        "num_hidden_layers": 27,
        "patch_size": 14,
        "vision_use_head": False,
    },
}

LTX2 = Arch(
    name="ltx2",
    description="LTX-2, video with audio (audio-video transformer 18.9B, Gemma-3 12B text encoder, text connectors, "
                "video VAE, audio VAE, vocoder)",
    class_name="LTX2Pipeline",
    components=(
        ComponentSpec("text_encoder", "transformers", "Gemma3ForConditionalGeneration", _frozen(GEMMA3_12B),
                      12_187_325_040),  # Gemma-3 12B, its 0.42B vision tower included
        # The ltx2 classes' defaults in diffusers are LTX-2's own configuration (LTX-2.0: one text projection).
        ComponentSpec("connectors", "ltx2", "LTX2TextConnectors", _frozen({}), None),
        ComponentSpec("transformer", "diffusers", "LTX2VideoTransformer3DModel", _frozen({}),
                      18_900_000_000, 0.01),  # published as "19B" (14B video, 5B audio); 18.88B by count
        # The video VAE states its ratios: the class would count its four scaling blocks in time and space alike.
        ComponentSpec("vae", "diffusers", "AutoencoderKLLTX2Video",
                      _frozen({"spatial_compression_ratio": 32, "temporal_compression_ratio": 8,
                               "timestep_conditioning": False}), None),
        ComponentSpec("audio_vae", "diffusers", "AutoencoderKLLTX2Audio", _frozen({}), None),
        ComponentSpec("vocoder", "ltx2", "LTX2Vocoder", _frozen({}), None),
    ),
)

ARCHS: Mapping[str, Arch] = MappingProxyType({a.name: a for a in (
    SD15, SDXL, FLUX, LUMINA2, COGVIEW4, FLUX_KONTEXT, FLUX_FILL, ZIMAGE, FLUX2_DEV, FLUX2_KLEIN, QWEN_IMAGE,
    QWEN_IMAGE_EDIT, QWEN_IMAGE_EDIT_PLUS, HUNYUAN_IMAGE21, WAN22_A14B, WAN22_I2V_A14B, WAN22_TI2V_5B, HUNYUAN_VIDEO15,
    LTX_VIDEO, LTX2)})


def get_arch(name: str) -> Arch:
    try:
        return ARCHS[name.lower()]
    except KeyError:
        raise MemfitError(f"Unknown architecture {name!r}; choose one of {', '.join(ARCHS)}.") from None
