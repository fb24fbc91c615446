"""Tiny diffusers pipelines built from configs with a fixed seed: no hub, no downloads.

These are the oracle every memfit optimization is held to: build one, save it in the diffusers
layout, and compare memfit's output with plain diffusers' on the same folder (see `parity.py`).
`scale` multiplies every width, so the same architectures serve as seconds-long unit tests
(scale=1) and as models big enough for memory measurements to rise above noise (scale=8 or more).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from memfit.testing.tokenizers import clip_tokenizer, word_tokenizer

PIPELINE_KINDS = ("sd", "sdxl", "lumina2", "cogview4", "flux", "flux_schnell", "sd3", "qwenimage", "chroma", "sana", "pixart_sigma",
                  "aura_flow", "hidream", "zimage", "flux_kontext", "flux2", "flux2_klein", "hunyuan_image")


def _vae(scale: int, *, levels: int = 2, latent_channels: int = 4, width: int = 16, **extra):
    from diffusers import AutoencoderKL

    width *= scale
    return AutoencoderKL(
        block_out_channels=[width * (2 ** min(i, 1)) for i in range(levels)],
        in_channels=3,
        out_channels=3,
        down_block_types=["DownEncoderBlock2D"] * levels,
        up_block_types=["UpDecoderBlock2D"] * levels,
        latent_channels=latent_channels,
        norm_num_groups=8,
        sample_size=32,
        **extra,
    )


def _clip_text(cls_name: str, tokenizer, hidden: int, layers: int, **extra):
    import transformers

    config = transformers.CLIPTextConfig(**{
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
        "hidden_size": hidden,
        "intermediate_size": hidden * 2,
        "num_attention_heads": 4,
        "num_hidden_layers": layers,
        "layer_norm_eps": 1e-5,
        "vocab_size": len(tokenizer),
        "max_position_embeddings": tokenizer.model_max_length,
        **extra,
    })
    return getattr(transformers, cls_name)(config).eval()


def _stable_diffusion(scale: int, text_layers: int, *, text_width: int, text_extra=None, **unet_changes):
    """A tiny StableDiffusionPipeline whose text encoder is ``text_width`` wide (``text_extra``: more of its
    config) and whose UNet's config has ``unet_changes``."""
    from diffusers import DDIMScheduler, StableDiffusionPipeline, UNet2DConditionModel

    tokenizer = clip_tokenizer()
    unet = UNet2DConditionModel(**{
        "block_out_channels": (16 * scale, 32 * scale),
        "layers_per_block": 1,
        "sample_size": 16,
        "in_channels": 4,
        "out_channels": 4,
        "down_block_types": ("DownBlock2D", "CrossAttnDownBlock2D"),
        "up_block_types": ("CrossAttnUpBlock2D", "UpBlock2D"),
        "cross_attention_dim": text_width,
        "norm_num_groups": 8,
        "attention_head_dim": 4,
        **unet_changes,
    })
    scheduler = DDIMScheduler(
        beta_start=0.00085,
        beta_end=0.012,
        beta_schedule="scaled_linear",
        clip_sample=False,
        set_alpha_to_one=False,
        steps_offset=1,
    )
    return StableDiffusionPipeline(
        vae=_vae(scale),
        text_encoder=_clip_text("CLIPTextModel", tokenizer, text_width, text_layers, **(text_extra or {})),
        tokenizer=tokenizer,
        unet=unet,
        scheduler=scheduler,
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )


def _sd(scale: int, text_layers: int):
    return _stable_diffusion(scale, text_layers, text_width=32 * scale)


def sdxl_unet(scale: int, *, pooled_dim: int, time_ids: int, cross_attention_dim: int):
    """The tiny SDXL-style UNet of the base and of the refiner: added conditions are the pooled
    text embedding (pooled_dim) plus `time_ids` embedded time ids."""
    from diffusers import UNet2DConditionModel

    time_embed = 8
    return UNet2DConditionModel(
        block_out_channels=(16 * scale, 32 * scale),
        layers_per_block=1,
        sample_size=16,
        in_channels=4,
        out_channels=4,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        attention_head_dim=(2, 4),
        use_linear_projection=True,
        addition_embed_type="text_time",
        addition_time_embed_dim=time_embed,
        transformer_layers_per_block=(1, 2),
        projection_class_embeddings_input_dim=pooled_dim + time_ids * time_embed,
        cross_attention_dim=cross_attention_dim,
        norm_num_groups=8,
    )


def _sdxl(scale: int, text_layers: int):
    from diffusers import EulerDiscreteScheduler, StableDiffusionXLPipeline

    tokenizer = clip_tokenizer()
    hidden = 16 * scale
    projection = 16 * scale
    # Six time ids: original size, crop, target size (each (h, w)).
    unet = sdxl_unet(scale, pooled_dim=projection, time_ids=6, cross_attention_dim=2 * hidden)
    scheduler = EulerDiscreteScheduler(
        beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", timestep_spacing="leading", steps_offset=1
    )
    return StableDiffusionXLPipeline(
        vae=_vae(scale, force_upcast=False),
        text_encoder=_clip_text("CLIPTextModel", tokenizer, hidden, text_layers),
        text_encoder_2=_clip_text("CLIPTextModelWithProjection", tokenizer, hidden, text_layers, projection_dim=projection),
        tokenizer=tokenizer,
        tokenizer_2=clip_tokenizer(),
        unet=unet,
        scheduler=scheduler,
        force_zeros_for_empty_prompt=False,
    )


def _sdxl_single_file(scale: int, text_layers: int):
    """The tiny SDXL as an all-in-one checkpoint needs it for diffusers to read the file back: diffusers
    finds SDXL by a tenth layer of the bigG encoder, and tells its two CLIP encoders apart by their width."""
    from diffusers import EulerDiscreteScheduler, StableDiffusionXLPipeline

    tokenizer = clip_tokenizer()
    hidden, hidden_2, projection = 16 * scale, 24 * scale, 16 * scale
    unet = sdxl_unet(scale, pooled_dim=projection, time_ids=6, cross_attention_dim=hidden + hidden_2)
    scheduler = EulerDiscreteScheduler(
        beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", timestep_spacing="leading", steps_offset=1
    )
    return StableDiffusionXLPipeline(
        vae=_vae(scale, force_upcast=False),
        text_encoder=_clip_text("CLIPTextModel", tokenizer, hidden, text_layers),
        text_encoder_2=_clip_text("CLIPTextModelWithProjection", tokenizer, hidden_2, max(text_layers, 10),
                                  projection_dim=projection),
        tokenizer=tokenizer,
        tokenizer_2=clip_tokenizer(),
        unet=unet,
        scheduler=scheduler,
        force_zeros_for_empty_prompt=False,
    )


def _sd2_single_file(scale: int, text_layers: int):
    """A tiny SD 2.x for an all-in-one checkpoint: diffusers finds SD 2 in a file by a cross-attention 1024 wide
    (its OpenCLIP encoder's width) in the first down block's second layer, so the text encoder is that wide
    (with a narrow MLP, to stay small) and the first down block has attention and two layers."""
    return _stable_diffusion(scale, text_layers, text_width=1024,
                             text_extra={"intermediate_size": 16 * scale, "hidden_act": "gelu"},
                             layers_per_block=2, down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
                             up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), use_linear_projection=True)


def _lumina2(scale: int, text_layers: int):
    from diffusers import FlowMatchEulerDiscreteScheduler, Lumina2Pipeline, Lumina2Transformer2DModel

    tokenizer = word_tokenizer()
    text_hidden = 16 * scale
    transformer = Lumina2Transformer2DModel(
        sample_size=4,
        patch_size=2,
        in_channels=4,
        hidden_size=8 * scale,
        num_layers=2,
        num_refiner_layers=1,
        num_attention_heads=scale,
        num_kv_heads=scale,
        multiple_of=16,
        norm_eps=1e-5,
        axes_dim_rope=(4, 2, 2),
        axes_lens=(300, 64, 64),
        cap_feat_dim=text_hidden,
    )
    text_encoder = _gemma2_encoder(tokenizer, text_hidden, text_layers)
    return Lumina2Pipeline(
        transformer=transformer,
        scheduler=FlowMatchEulerDiscreteScheduler(),
        # Lumina2Pipeline hard-codes a VAE scale factor of 8, so the VAE needs three downsamplings.
        vae=_vae(scale, levels=4, scaling_factor=1.5035, shift_factor=0.0609),
        text_encoder=text_encoder,
        tokenizer=tokenizer,
    )


def _cogview4(scale: int, text_layers: int):
    from diffusers import CogView4Pipeline, CogView4Transformer2DModel, FlowMatchEulerDiscreteScheduler
    from transformers import GlmConfig, GlmModel

    tokenizer = word_tokenizer()
    text_hidden = 16 * scale
    transformer = CogView4Transformer2DModel(
        patch_size=2,
        in_channels=4,
        num_layers=2,
        attention_head_dim=4,
        num_attention_heads=2 * scale,
        out_channels=4,
        text_embed_dim=text_hidden,
        time_embed_dim=8,
        condition_dim=4,
    )
    text_encoder = GlmModel(
        GlmConfig(
            hidden_size=text_hidden,
            intermediate_size=2 * text_hidden,
            num_hidden_layers=text_layers,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=4,
            vocab_size=len(tokenizer),
            pad_token_id=tokenizer.pad_token_id,
        )
    ).eval()
    scheduler = FlowMatchEulerDiscreteScheduler(
        base_shift=0.25, max_shift=0.75, base_image_seq_len=256, use_dynamic_shifting=True, time_shift_type="linear"
    )
    return CogView4Pipeline(
        tokenizer=tokenizer,
        text_encoder=text_encoder,
        vae=_vae(scale),
        transformer=transformer,
        scheduler=scheduler,
    )


def _t5_encoder(tokenizer, hidden: int, layers: int, cls_name: str = "T5EncoderModel", **extra):
    """A tiny T5 (or UMT5) encoder for the word tokenizer; stands in for T5-XXL / UMT5-XXL."""
    import transformers

    config_class = transformers.UMT5Config if cls_name.startswith("UMT5") else transformers.T5Config
    config = config_class(
        vocab_size=len(tokenizer),
        d_model=hidden,
        d_kv=8,
        d_ff=2 * hidden,
        num_layers=layers,
        num_heads=2,
        relative_attention_num_buckets=8,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        decoder_start_token_id=tokenizer.pad_token_id,
        **extra,
    )
    return getattr(transformers, cls_name)(config).eval()


def _flux(scale: int, text_layers: int, *, guidance_embeds: bool = True, vae_levels: int = 2, vae_width: int = 16):
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel

    tokenizer = clip_tokenizer()
    clip_hidden = 16 * scale
    t5_tokenizer = word_tokenizer()
    t5_hidden = 16 * scale
    latent_channels = 4
    transformer = FluxTransformer2DModel(
        patch_size=1,
        in_channels=4 * latent_channels,  # latents are packed in 2x2 patches
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=16,
        num_attention_heads=2 * scale,
        joint_attention_dim=t5_hidden,
        pooled_projection_dim=clip_hidden,
        guidance_embeds=guidance_embeds,
        axes_dims_rope=(4, 4, 8),
    )
    return FluxPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(),
        vae=_vae(scale, levels=vae_levels, width=vae_width, latent_channels=latent_channels, scaling_factor=1.5035, shift_factor=0.0609,
                 use_quant_conv=False, use_post_quant_conv=False),
        text_encoder=_clip_text("CLIPTextModel", tokenizer, clip_hidden, text_layers),
        tokenizer=tokenizer,
        text_encoder_2=_t5_encoder(t5_tokenizer, t5_hidden, text_layers),
        tokenizer_2=t5_tokenizer,
        transformer=transformer,
    )


def _flux_schnell(scale: int, text_layers: int):
    return _flux(scale, text_layers, guidance_embeds=False)


def _flux_kontext(scale: int, text_layers: int):
    """FLUX.1 Kontext: a Flux folder whose model_index.json names FluxKontextPipeline (the same components).

    The pipeline resizes every input image to one of Kontext's trained resolutions (672 to 1568 pixels a
    side), whatever its size: a VAE that shrinks 16x (five levels) keeps that image's latents a tiny
    transformer's thousand tokens, and a narrow one (8 channels) keeps its encoder quick at that size."""
    from diffusers import FluxKontextPipeline

    return FluxKontextPipeline(**_flux(scale, text_layers, vae_levels=5, vae_width=8).components)


def _flux_fill(scale: int, text_layers: int):
    """FLUX.1 Fill: Flux's components, its transformer's input widened by the masked image's latents and the mask
    folded into the latent grid (the real one's 64 + 64 + 256 = 384 channels; here 16 + 16 + 16), its output
    Flux's 4 x latent channels."""
    from diffusers import FluxFillPipeline, FluxTransformer2DModel

    components = _flux(scale, text_layers).components
    packed = components["transformer"].config.in_channels
    scale_factor = 2 ** (len(components["vae"].config.block_out_channels) - 1)
    config = {name: value for name, value in components["transformer"].config.items() if not name.startswith("_")}
    config.update(in_channels=2 * packed + 4 * scale_factor ** 2, out_channels=packed)
    components["transformer"] = FluxTransformer2DModel(**config).eval()
    taken = ("scheduler", "vae", "text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2", "transformer")
    return FluxFillPipeline(**{name: components[name] for name in taken})  # FluxPipeline's IP-Adapter slots aside


def _sd3(scale: int, text_layers: int, *, clip_g_hidden: int | None = None, latent_channels: int = 4,
         quant_conv: bool = True):
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline

    tokenizer = clip_tokenizer()
    clip_hidden = 16 * scale
    clip_g_hidden = clip_g_hidden or clip_hidden
    t5_tokenizer = word_tokenizer()
    t5_hidden = clip_hidden + clip_g_hidden  # the CLIP-L and CLIP-G embeddings, concatenated, are padded to T5's width
    inner = 32 * scale
    transformer = SD3Transformer2DModel(
        sample_size=16,
        patch_size=2,
        in_channels=latent_channels,
        num_layers=2,
        attention_head_dim=8,
        num_attention_heads=inner // 8,
        joint_attention_dim=t5_hidden,
        caption_projection_dim=inner,
        pooled_projection_dim=clip_hidden + clip_g_hidden,  # both CLIP projections
        out_channels=latent_channels,
        pos_embed_max_size=16,
    )
    return StableDiffusion3Pipeline(
        transformer=transformer,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        vae=_vae(scale, latent_channels=latent_channels, scaling_factor=1.5305, shift_factor=0.0609,
                 use_quant_conv=quant_conv, use_post_quant_conv=quant_conv),
        text_encoder=_clip_text("CLIPTextModelWithProjection", tokenizer, clip_hidden, text_layers, projection_dim=clip_hidden),
        tokenizer=tokenizer,
        text_encoder_2=_clip_text("CLIPTextModelWithProjection", tokenizer, clip_g_hidden, text_layers,
                                  projection_dim=clip_g_hidden),
        tokenizer_2=clip_tokenizer(),
        text_encoder_3=_t5_encoder(t5_tokenizer, t5_hidden, text_layers),
        tokenizer_3=t5_tokenizer,
    )


def _sd3_single_file(scale: int, text_layers: int):
    """The tiny SD3 as Stability's all-in-one checkpoint needs it for diffusers to read the file back: diffusers
    tells CLIP-L from CLIP-G by their width, and runs a file's CLIP-L with the identity as its projection. Like
    SD3's own VAE, its VAE has 16 latent channels and no quant convolutions; every tensor is a whole number of
    64-byte lines, so the file (memfit.testing.single_file.save_aligned) places each aligned, as memory does."""
    pipe = _sd3(scale, text_layers, clip_g_hidden=32 * scale, latent_channels=16, quant_conv=False)
    with torch.no_grad():
        projection = pipe.text_encoder.text_projection.weight
        projection.copy_(torch.eye(projection.shape[0]))
    return pipe


# The words of QwenImagePipeline's prompt template, so the template does not tokenize to unknowns.
_QWEN_TEMPLATE_WORDS = (
    "im_start im_end system user assistant describe image by detailing color shape size texture quantity text "
    "spatial relationships objects background"
).split()


def _qwen2_5_vl(tokenizer, text_hidden: int, text_layers: int, vision_tokens: dict[str, int] | None = None):
    """A tiny Qwen2.5-VL for the word tokenizer; stands in for Qwen2.5-VL-7B (QwenImage, HunyuanImage 2.1).
    ``vision_tokens``: the ids of the tokenizer's vision tokens (_QWEN_VISION_TOKENS), where prompts show it images."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    vocab = len(tokenizer)
    # Vision tokens never occur in a text prompt: ids past the word vocabulary, unless the tokenizer has them.
    vision_tokens = vision_tokens or {token: vocab + index + 1 for index, token in enumerate(_QWEN_VISION_TOKENS)}
    return Qwen2_5_VLForConditionalGeneration(
        Qwen2_5_VLConfig(
            text_config={
                "hidden_size": text_hidden, "intermediate_size": 2 * text_hidden, "num_hidden_layers": text_layers,
                "num_attention_heads": 2, "num_key_value_heads": 2, "vocab_size": vocab,
                "rope_scaling": {"mrope_section": [1, 1, 2], "rope_type": "default", "type": "default"},
                "rope_theta": 1000000.0, "pad_token_id": tokenizer.pad_token_id,
                "bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
            },
            vision_config={"depth": 1, "hidden_size": 16, "intermediate_size": 16, "num_heads": 2,
                           "out_hidden_size": text_hidden},
            vision_start_token_id=vision_tokens["<|vision_start|>"], vision_end_token_id=vision_tokens["<|vision_end|>"],
            image_token_id=vision_tokens["<|image_pad|>"], video_token_id=vision_tokens["<|video_pad|>"], vocab_size=vocab,
        )
    ).eval()


def _qwenimage(scale: int, text_layers: int):
    from diffusers import QwenImagePipeline

    from memfit.testing.tokenizers import DEFAULT_WORDS

    tokenizer = word_tokenizer([*DEFAULT_WORDS, *_QWEN_TEMPLATE_WORDS])
    text_hidden = 16 * scale
    text_encoder = _qwen2_5_vl(tokenizer, text_hidden, text_layers)
    return QwenImagePipeline(text_encoder=text_encoder, tokenizer=tokenizer,
                             **_qwenimage_parts(scale, text_hidden, dim_mult=[1, 2, 4], temperal_downsample=[False, True]))


# The tokens Qwen2-VL's processor puts an image between (and a video's, which the edit pipelines never send).
_QWEN_VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
# The words of the edit pipelines' prompt templates besides QwenImage's.
_QWEN_EDIT_TEMPLATE_WORDS = (
    "key features input then explain how instruction should alter or modify generate new that meets requirements "
    "while maintaining consistency original where appropriate picture"
).split()


def _qwenimage_edit(scale: int, text_layers: int, pipeline_class: str = "QwenImageEditPipeline"):
    """Qwen-Image-Edit: QwenImage's transformer, a Qwen2.5-VL that sees images through a Qwen2-VL processor.

    The pipeline encodes every input image at about 1024 x 1024 pixels with the VAE: one that shrinks 32x
    (five levels) and is narrow keeps that quick and the image's latents a few hundred tokens. The processor
    shows the text encoder at most 112 x 112 pixels (16 tokens); it has no video processor, which needs
    torchvision (memfit.models.families.qwenimage_edit), and save_pipeline names it Qwen2VLProcessor."""
    import diffusers
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from memfit.models.families.qwenimage_edit import image_only_processor
    from memfit.testing.tokenizers import DEFAULT_WORDS

    tokenizer = word_tokenizer([*DEFAULT_WORDS, *_QWEN_TEMPLATE_WORDS, *_QWEN_EDIT_TEMPLATE_WORDS])
    tokenizer.add_special_tokens({"additional_special_tokens": list(_QWEN_VISION_TOKENS)})
    vision_tokens = {token: tokenizer.convert_tokens_to_ids(token) for token in _QWEN_VISION_TOKENS}
    text_hidden = 16 * scale
    text_encoder = _qwen2_5_vl(tokenizer, text_hidden, text_layers, vision_tokens)
    processor = image_only_processor(Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=112 * 112), tokenizer)
    return getattr(diffusers, pipeline_class)(
        text_encoder=text_encoder, tokenizer=tokenizer, processor=processor,
        **_qwenimage_parts(scale, text_hidden, dim_mult=[1] * 6, temperal_downsample=[False] * 5))


def _qwenimage_edit_plus(scale: int, text_layers: int):
    return _qwenimage_edit(scale, text_layers, "QwenImageEditPlusPipeline")


def _qwenimage_parts(scale: int, text_hidden: int, **vae_levels):
    """The QwenImage pipelines' transformer, scheduler and VAE (its levels: ``vae_levels``), for a text encoder
    ``text_hidden`` wide."""
    from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImageTransformer2DModel

    latent_channels = 4
    transformer = QwenImageTransformer2DModel(
        patch_size=2,
        in_channels=4 * latent_channels,  # latents are packed in 2x2 patches
        out_channels=latent_channels,
        num_layers=2,
        attention_head_dim=16,
        num_attention_heads=2 * scale,
        joint_attention_dim=text_hidden,
        guidance_embeds=False,
        axes_dims_rope=(8, 4, 4),
    )
    vae = AutoencoderKLQwenImage(base_dim=4 * scale, z_dim=latent_channels, num_res_blocks=1,
                                 latents_mean=[0.1, -0.2, 0.05, 0.3], latents_std=[1.5, 0.8, 1.2, 2.0], **vae_levels)
    return dict(scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae, transformer=transformer)


def _hunyuan_image(scale: int, text_layers: int):
    """HunyuanImage 2.1: a tiny Qwen2.5-VL, a tiny T5 encoder with the byte-level ByT5 tokenizer (for the
    quoted text of a prompt), and guiders whose adaptive projected guidance starts at step 1, so a
    few-step test runs both its CFG and its APG branch."""
    from diffusers import (AdaptiveProjectedMixGuidance, AutoencoderKLHunyuanImage, FlowMatchEulerDiscreteScheduler,
                           HunyuanImagePipeline, HunyuanImageTransformer2DModel)
    from transformers import ByT5Tokenizer

    from memfit.testing.tokenizers import DEFAULT_WORDS

    tokenizer = word_tokenizer([*DEFAULT_WORDS, *_QWEN_TEMPLATE_WORDS])
    text_hidden = 16 * scale
    tokenizer_2 = ByT5Tokenizer()
    latent_channels = 4
    transformer = HunyuanImageTransformer2DModel(
        in_channels=latent_channels, out_channels=latent_channels, num_attention_heads=2 * scale,
        attention_head_dim=16, num_layers=1, num_single_layers=1, num_refiner_layers=1,
        text_embed_dim=text_hidden, text_embed_2_dim=text_hidden, rope_axes_dim=(8, 8),
    )
    vae = AutoencoderKLHunyuanImage(
        in_channels=3, out_channels=3, latent_channels=latent_channels, block_out_channels=(32, 32),
        layers_per_block=1, spatial_compression_ratio=2, sample_size=32, scaling_factor=0.75,
    )
    return HunyuanImagePipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(shift=4.0),
        vae=vae,
        text_encoder=_qwen2_5_vl(tokenizer, text_hidden, text_layers),
        tokenizer=tokenizer,
        text_encoder_2=_t5_encoder(tokenizer_2, text_hidden, text_layers),
        tokenizer_2=tokenizer_2,
        transformer=transformer,
        guider=AdaptiveProjectedMixGuidance(guidance_scale=3.5, adaptive_projected_guidance_start_step=1),
        ocr_guider=AdaptiveProjectedMixGuidance(guidance_scale=3.5, adaptive_projected_guidance_start_step=0),
    )


def _hunyuan_video15(scale: int, text_layers: int, *, image_to_video: bool = False):
    """HunyuanVideo 1.5 text to video: HunyuanImage's tiny encoders (a Qwen2.5-VL text model, as the real folder's,
    and a T5 encoder with the byte-level ByT5 tokenizer), a two-block transformer and a 4x (4x in time) video VAE.
    The pipeline crops the first 108 tokens of its chat template (the real template's system turn): this
    tokenizer's template pads its system turn to that length, so the prompt is what remains.
    ``image_to_video``: HunyuanVideo15ImageToVideoPipeline's, with a tiny SigLIP image encoder whose tokens the
    transformer attends to."""
    import transformers
    from diffusers import (AutoencoderKLHunyuanVideo15, ClassifierFreeGuidance, FlowMatchEulerDiscreteScheduler,
                           HunyuanVideo15ImageToVideoPipeline, HunyuanVideo15Pipeline, HunyuanVideo15Transformer3DModel)
    from transformers import ByT5Tokenizer, Qwen2_5_VLTextConfig, Qwen2_5_VLTextModel

    from memfit.testing.tokenizers import DEFAULT_WORDS

    tokenizer = word_tokenizer([*DEFAULT_WORDS, *_QWEN_TEMPLATE_WORDS])
    system, crop = HunyuanVideo15Pipeline._get_mllm_prompt_embeds.__defaults__[-2:]  # its system message, 108

    def prompt_start(template):
        tokenizer.chat_template = template
        ids = tokenizer.apply_chat_template([{"role": "system", "content": system}, {"role": "user", "content": "cat"}],
                                            tokenize=True, add_generation_prompt=True, return_dict=True)["input_ids"]
        return ids.index(tokenizer.convert_tokens_to_ids("cat"))

    filler = " im_end" * (crop - prompt_start(_QWEN3_CHAT_TEMPLATE))
    template = _QWEN3_CHAT_TEMPLATE.replace(
        "{{ message.content }}", "{{ message.content }}{% if message.role == 'system' %}" + filler + "{% endif %}")
    assert prompt_start(template) == crop, "the tiny chat template's prompt must start where the pipeline crops"
    text_hidden = 16 * scale
    text_encoder = Qwen2_5_VLTextModel(Qwen2_5_VLTextConfig(
        hidden_size=text_hidden, intermediate_size=2 * text_hidden, num_hidden_layers=text_layers,
        num_attention_heads=2, num_key_value_heads=2, vocab_size=len(tokenizer),
        rope_scaling={"mrope_section": [1, 1, 2], "rope_type": "default", "type": "default"},
        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id)).eval()
    tokenizer_2 = ByT5Tokenizer()
    latent_channels = 4
    # The ByT5 projection is 2048 wide whatever the config (17 MB): blocks about half its size let a budget below
    # the transformer's weights stream them.
    transformer = HunyuanVideo15Transformer3DModel(
        in_channels=2 * latent_channels + 1,  # the noise, the condition latents and their mask (zeros in t2v)
        out_channels=latent_channels, num_attention_heads=2 * scale, attention_head_dim=128, num_layers=2,
        num_refiner_layers=1, text_embed_dim=text_hidden, text_embed_2_dim=text_hidden, image_embed_dim=16 * scale,
        rope_axes_dim=(16, 56, 56), target_size=32, task_type="i2v" if image_to_video else "t2v",
    )
    vae = AutoencoderKLHunyuanVideo15(
        in_channels=3, out_channels=3, latent_channels=latent_channels, block_out_channels=(8 * scale,) * 3,
        layers_per_block=1, spatial_compression_ratio=4, temporal_compression_ratio=4, scaling_factor=0.75,
    )
    components = dict(
        scheduler=FlowMatchEulerDiscreteScheduler(shift=5.0),
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        text_encoder_2=_t5_encoder(tokenizer_2, text_hidden, text_layers),
        tokenizer_2=tokenizer_2,
        transformer=transformer,
        guider=ClassifierFreeGuidance(guidance_scale=6.0),
    )
    if not image_to_video:
        return HunyuanVideo15Pipeline(**components)
    vision = transformers.SiglipVisionConfig(hidden_size=16 * scale, intermediate_size=32 * scale, num_hidden_layers=1,
                                             num_attention_heads=2, image_size=32, patch_size=8)
    return HunyuanVideo15ImageToVideoPipeline(
        **components, image_encoder=transformers.SiglipVisionModel(vision).eval(),
        feature_extractor=transformers.SiglipImageProcessor(size={"height": 32, "width": 32}))


def _hunyuan_video15_i2v(scale: int, text_layers: int):
    return _hunyuan_video15(scale, text_layers, image_to_video=True)


def _ltx(scale: int, text_layers: int, *, image_to_video: bool = False):
    """LTX-Video: a tiny T5 encoder, a two-block transformer and an 8x (4x in time) video VAE that patchifies
    (2x2 pixels; the real one's 4x4, 32x and 8x in time) and whose decoder is conditioned on the decode timestep,
    as LTX-Video 0.9.1's and later ones' are.
    ``image_to_video``: LTXImageToVideoPipeline's, the same components."""
    from diffusers import (AutoencoderKLLTXVideo, FlowMatchEulerDiscreteScheduler, LTXImageToVideoPipeline,
                           LTXPipeline, LTXVideoTransformer3DModel)

    tokenizer = word_tokenizer()
    text_hidden = 16 * scale
    latent_channels = 4
    transformer = LTXVideoTransformer3DModel(
        in_channels=latent_channels, out_channels=latent_channels, patch_size=1, patch_size_t=1,
        num_attention_heads=2 * scale, attention_head_dim=12, cross_attention_dim=24 * scale, num_layers=2,
        caption_channels=text_hidden,
    )
    width = 8 * scale
    vae = AutoencoderKLLTXVideo(
        latent_channels=latent_channels, block_out_channels=(width,) * 4, decoder_block_out_channels=(width,) * 4,
        layers_per_block=(1,) * 5, decoder_layers_per_block=(1,) * 5,
        spatio_temporal_scaling=(True, True, False, False), decoder_spatio_temporal_scaling=(True, True, False, False),
        decoder_inject_noise=(False,) * 5, upsample_residual=(False,) * 4, upsample_factor=(1,) * 4,
        timestep_conditioning=True, patch_size=2, patch_size_t=1, scaling_factor=0.75,
    )
    # A VAE's latents_mean/latents_std are weights (buffers); the real ones are not zeros and ones either.
    vae.latents_mean.copy_(torch.tensor([0.1, -0.2, 0.05, 0.3]))
    vae.latents_std.copy_(torch.tensor([1.5, 0.8, 1.2, 2.0]))
    pipeline_class = LTXImageToVideoPipeline if image_to_video else LTXPipeline
    return pipeline_class(
        scheduler=FlowMatchEulerDiscreteScheduler(shift=1.0, use_dynamic_shifting=True, base_image_seq_len=16,
                                                  max_image_seq_len=256, base_shift=0.95, max_shift=2.05),
        vae=vae,
        text_encoder=_t5_encoder(tokenizer, text_hidden, text_layers),
        tokenizer=tokenizer,
        transformer=transformer,
    )


def _ltx_i2v(scale: int, text_layers: int):
    return _ltx(scale, text_layers, image_to_video=True)


def _ltx2(scale: int, text_layers: int, *, image_to_video: bool = False):
    """LTX-2: a tiny Gemma-3 (with its vision tower, as Gemma3ForConditionalGeneration has), one-block text
    connectors, a two-block audio-video transformer, an 8x (4x in time) video VAE that patchifies (2x2 pixels; the
    real one's 4x4, 32x and 8x in time), an audio VAE of 16 mel bins and a vocoder that makes 8 kHz stereo.
    ``image_to_video``: LTX2ImageToVideoPipeline's, the same components."""
    from diffusers import (AutoencoderKLLTX2Audio, AutoencoderKLLTX2Video, FlowMatchEulerDiscreteScheduler,
                           LTX2ImageToVideoPipeline, LTX2Pipeline, LTX2VideoTransformer3DModel)
    from diffusers.pipelines.ltx2.connectors import LTX2TextConnectors
    from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    tokenizer = word_tokenizer()
    text_hidden = 16 * scale
    vocabulary = len(tokenizer) + 3  # the image tokens after the words: a prompt never holds them
    text_encoder = Gemma3ForConditionalGeneration(Gemma3Config(
        text_config=dict(hidden_size=text_hidden, intermediate_size=2 * text_hidden, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=8, num_hidden_layers=text_layers, vocab_size=vocabulary,
                         sliding_window=8, pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id),
        vision_config=dict(hidden_size=16, intermediate_size=32, num_attention_heads=2, num_hidden_layers=1,
                           image_size=28, patch_size=14),
        mm_tokens_per_image=4, image_token_index=len(tokenizer), boi_token_index=len(tokenizer) + 1,
        eoi_token_index=len(tokenizer) + 2)).eval()
    connector = dict(num_attention_heads=2, attention_head_dim=8 * scale, num_layers=1, num_learnable_registers=8)
    connectors = LTX2TextConnectors(caption_channels=text_hidden, text_proj_in_factor=text_layers + 1,
                                    **{f"{stream}_connector_{key}": value for stream in ("video", "audio")
                                       for key, value in connector.items()})
    latent_channels, audio_channels, mel_bins = 4, 2, 16
    transformer = LTX2VideoTransformer3DModel(
        in_channels=latent_channels, out_channels=latent_channels, num_attention_heads=2 * scale, attention_head_dim=8,
        cross_attention_dim=16 * scale, audio_in_channels=audio_channels * mel_bins // 4, audio_out_channels=None,
        audio_num_attention_heads=2, audio_attention_head_dim=4, audio_cross_attention_dim=8, num_layers=2,
        caption_channels=text_hidden, vae_scale_factors=(4, 8, 8))
    width = 8 * scale
    vae = AutoencoderKLLTX2Video(
        latent_channels=latent_channels, block_out_channels=(width,) * 4, decoder_block_out_channels=(width,) * 3,
        layers_per_block=(1,) * 5, decoder_layers_per_block=(1,) * 4,
        spatio_temporal_scaling=(True, True, False, False), decoder_spatio_temporal_scaling=(True, True, False),
        # the encoder's two scaling blocks scale time and space alike, as the ratios the class states assume
        downsample_type=("spatiotemporal", "spatiotemporal", "spatial", "spatial"),
        decoder_inject_noise=(False,) * 4, upsample_residual=(False,) * 3, upsample_factor=(1,) * 3,
        timestep_conditioning=True, patch_size=2, patch_size_t=1, scaling_factor=0.75)
    # The VAEs' latents_mean/latents_std are weights (buffers); the real ones are not zeros and ones either.
    vae.latents_mean.copy_(torch.tensor([0.1, -0.2, 0.05, 0.3]))
    vae.latents_std.copy_(torch.tensor([1.5, 0.8, 1.2, 2.0]))
    audio_vae = AutoencoderKLLTX2Audio(base_channels=audio_channels * mel_bins // 4, output_channels=2, ch_mult=(1, 2),
                                       num_res_blocks=1, latent_channels=audio_channels, mel_bins=mel_bins,
                                       resolution=16)
    audio_vae.latents_mean.copy_(torch.linspace(-0.3, 0.3, audio_vae.latents_mean.numel()))
    audio_vae.latents_std.copy_(torch.linspace(0.5, 1.5, audio_vae.latents_std.numel()))
    # 16 kHz mel frames of 160 samples, 80 output samples each: 8 kHz
    vocoder = LTX2Vocoder(in_channels=2 * mel_bins, hidden_channels=16, out_channels=2, upsample_kernel_sizes=[20, 16],
                          upsample_factors=[10, 8], resnet_kernel_sizes=[3], resnet_dilations=[[1]],
                          output_sampling_rate=8000)
    return (LTX2ImageToVideoPipeline if image_to_video else LTX2Pipeline)(
        scheduler=FlowMatchEulerDiscreteScheduler(shift=1.0, use_dynamic_shifting=True, base_image_seq_len=16,
                                                  max_image_seq_len=256, base_shift=0.95, max_shift=2.05),
        vae=vae, audio_vae=audio_vae, text_encoder=text_encoder, tokenizer=tokenizer, connectors=connectors,
        transformer=transformer, vocoder=vocoder,
    )


def _ltx2_i2v(scale: int, text_layers: int):
    return _ltx2(scale, text_layers, image_to_video=True)


def _wan(scale: int, text_layers: int, boundary_ratio: float | None = None, ffn_dim: int | None = None, *,
         image_to_video: bool = False, image_encoder=None, image_processor=None):
    """A tiny Wan pipeline; ``image_to_video``: WanImageToVideoPipeline's, whose transformers also take the
    condition latents and mask beside the noise, and (with ``image_encoder``, Wan 2.1's) the CLIP image tokens."""
    from diffusers import (AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanImageToVideoPipeline, WanPipeline,
                           WanTransformer3DModel)

    tokenizer = word_tokenizer()
    text_hidden = 16 * scale
    latent_channels = 4
    vae = AutoencoderKLWan(
        base_dim=4 * scale,
        z_dim=latent_channels,
        dim_mult=[1, 1, 1, 1],  # three downsamplings: 8x spatially
        num_res_blocks=1,
        temperal_downsample=[False, True, True],  # 4x in time
        latents_mean=[0.1, -0.2, 0.05, 0.3],
        latents_std=[1.5, 0.8, 1.2, 2.0],
    )
    experts = [WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=2 * scale,
        attention_head_dim=12,
        # image to video: the noise, then the mask (one channel per frame of a temporal group) and the condition
        in_channels=latent_channels * 2 + 4 if image_to_video else latent_channels,
        out_channels=latent_channels,
        text_dim=text_hidden,
        image_dim=None if image_encoder is None else image_encoder.config.hidden_size,
        added_kv_proj_dim=None if image_encoder is None else 24 * scale,
        freq_dim=32,
        ffn_dim=ffn_dim or 32 * scale,
        num_layers=2,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        rope_max_seq_len=32,
    ) for _ in range(1 if boundary_ratio is None else 2)]
    components = dict(
        tokenizer=tokenizer,
        text_encoder=_t5_encoder(tokenizer, text_hidden, text_layers, "UMT5EncoderModel"),
        vae=vae,
        transformer=experts[0],
        transformer_2=experts[1] if boundary_ratio is not None else None,
        boundary_ratio=boundary_ratio,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=7.0),
    )
    if image_to_video:
        return WanImageToVideoPipeline(**components, image_encoder=image_encoder, image_processor=image_processor)
    return WanPipeline(**components)


def _wan22(scale: int, text_layers: int):
    """Wan 2.2 A14B's layout: two experts of one architecture (transformer for the high-noise steps,
    transformer_2 for the low-noise ones), switched at boundary_ratio of the training timesteps. Wide
    feed-forward layers make each expert about 25 MB (fast: the tiny video has 32 tokens), so the memory
    tests see in RSS which expert is in memory."""
    return _wan(scale, text_layers, boundary_ratio=0.875, ffn_dim=2**16 * scale)


def _wan22_narrow(scale: int, text_layers: int):
    """Wan 2.2 A14B's layout with the narrow feed-forward layers of the tiny Wan 2.1 model, for tests that read its
    experts from single files: at scale 4 every tensor is a whole number of 64-byte lines, so files written with
    memfit.testing.single_file.save_aligned hold each one aligned as in memory (a one-row matmul may round
    differently on an unaligned bias)."""
    return _wan(scale, text_layers, boundary_ratio=0.875)


def _clip_vision(scale: int, image_size: int = 32):
    """A tiny CLIPVisionModel and the CLIPImageProcessor that feeds it ``image_size`` pixels a side."""
    import transformers

    config = transformers.CLIPVisionConfig(hidden_size=16 * scale, intermediate_size=32 * scale, num_attention_heads=2,
                                           num_hidden_layers=2, image_size=image_size, patch_size=8)
    processor = transformers.CLIPImageProcessor(size={"shortest_edge": image_size},
                                                crop_size={"height": image_size, "width": image_size})
    return transformers.CLIPVisionModel(config).eval(), processor


def _wan_i2v(scale: int, text_layers: int):
    """Wan 2.1 I2V's layout: one transformer that also attends to a CLIP image encoder's tokens of the input
    image (its second-to-last hidden layer), beside the VAE's latents of it."""
    image_encoder, image_processor = _clip_vision(scale)
    return _wan(scale, text_layers, image_to_video=True, image_encoder=image_encoder, image_processor=image_processor)


def _wan22_i2v(scale: int, text_layers: int):
    """Wan 2.2 I2V A14B's layout: two experts switched at boundary_ratio, no image encoder (the input image
    reaches the transformers only as the VAE's latents)."""
    return _wan(scale, text_layers, boundary_ratio=0.9, image_to_video=True)


def _wan22_ti2v(scale: int, text_layers: int):
    """Wan 2.2 TI2V-5B's layout: a WanPipeline folder with expand_timesteps (each latent patch its own timestep, an
    input image's latents kept as the first frame at timestep 0) and the Wan 2.2 VAE, which patchifies 2x2 before
    its three downsamplings (16x spatially) and adds residual shortcuts."""
    from diffusers import AutoencoderKLWan, WanPipeline

    parts = _wan(scale, text_layers).components
    vae = AutoencoderKLWan(
        base_dim=4 * scale,
        decoder_base_dim=8 * scale,
        z_dim=4,
        dim_mult=[1, 1, 1, 1],
        num_res_blocks=1,
        temperal_downsample=[False, True, True],
        latents_mean=[0.1, -0.2, 0.05, 0.3],
        latents_std=[1.5, 0.8, 1.2, 2.0],
        is_residual=True,
        in_channels=12,
        out_channels=12,
        patch_size=2,
        scale_factor_spatial=16,
        scale_factor_temporal=4,
    )
    return WanPipeline(**dict(parts, vae=vae), expand_timesteps=True)


def _chroma(scale: int, text_layers: int):
    from diffusers import ChromaPipeline, ChromaTransformer2DModel, FlowMatchEulerDiscreteScheduler

    tokenizer = word_tokenizer()
    text_hidden = 16 * scale
    latent_channels = 4
    transformer = ChromaTransformer2DModel(
        patch_size=1,
        in_channels=4 * latent_channels,  # latents are packed in 2x2 patches
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=16,
        num_attention_heads=2 * scale,
        joint_attention_dim=text_hidden,
        axes_dims_rope=(4, 4, 8),
        approximator_num_channels=16,
        approximator_hidden_dim=32,
        approximator_layers=1,
    )
    return ChromaPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(),
        vae=_vae(scale, latent_channels=latent_channels, scaling_factor=1.5035, shift_factor=0.0609,
                 use_quant_conv=False, use_post_quant_conv=False),
        text_encoder=_t5_encoder(tokenizer, text_hidden, text_layers),
        tokenizer=tokenizer,
        transformer=transformer,
    )


def _gemma2_encoder(tokenizer, hidden: int, layers: int):
    from transformers import Gemma2Config, Gemma2Model

    return Gemma2Model(
        Gemma2Config(
            head_dim=4,
            hidden_size=hidden,
            intermediate_size=2 * hidden,
            num_attention_heads=4,
            num_hidden_layers=layers,
            num_key_value_heads=2,
            vocab_size=len(tokenizer),
            pad_token_id=tokenizer.pad_token_id,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
    ).eval()


def _sana(scale: int, text_layers: int):
    from diffusers import AutoencoderDC, FlowMatchEulerDiscreteScheduler, SanaPipeline, SanaTransformer2DModel

    tokenizer = word_tokenizer()
    text_hidden = 16 * scale
    latent_channels = 4
    # SanaPipeline bins the requested size to its aspect-ratio table (sample_size 16: the 512 px table) and
    # resizes back after decoding, so a 32 px request runs at 512 px: the VAE compresses 32x, as Sana's does.
    levels = 6
    vae = AutoencoderDC(
        in_channels=3,
        latent_channels=latent_channels,
        attention_head_dim=2,
        encoder_block_types=("ResBlock",) * levels,
        decoder_block_types=("ResBlock",) * levels,
        encoder_block_out_channels=(4 * scale,) * levels,
        decoder_block_out_channels=(4 * scale,) * levels,
        encoder_layers_per_block=(1,) * levels,
        decoder_layers_per_block=(1,) * levels,
        encoder_qkv_multiscales=((),) * levels,
        decoder_qkv_multiscales=((),) * levels,
        upsample_block_type="interpolate",
        downsample_block_type="Conv",
        decoder_norm_types="rms_norm",
        decoder_act_fns="silu",
        scaling_factor=0.41407,
    )
    transformer = SanaTransformer2DModel(
        patch_size=1,
        in_channels=latent_channels,
        out_channels=latent_channels,
        num_layers=2,
        num_attention_heads=2 * scale,
        attention_head_dim=8,
        num_cross_attention_heads=2 * scale,
        cross_attention_head_dim=8,
        cross_attention_dim=16 * scale,
        caption_channels=text_hidden,
        sample_size=16,
    )
    return SanaPipeline(
        tokenizer=tokenizer,
        text_encoder=_gemma2_encoder(tokenizer, text_hidden, text_layers),
        vae=vae,
        transformer=transformer,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
    )


def _pixart_sigma(scale: int, text_layers: int):
    from diffusers import DPMSolverMultistepScheduler, PixArtSigmaPipeline, PixArtTransformer2DModel

    tokenizer = word_tokenizer()
    text_hidden = 16 * scale
    # PixArtSigmaPipeline bins the requested size to its aspect-ratio table (sample_size 32: the 256 px table)
    # and resizes back after decoding, so a 32 px request runs at 256 px through an 8x VAE.
    transformer = PixArtTransformer2DModel(
        sample_size=32,
        num_layers=4,
        patch_size=2,
        attention_head_dim=16,
        num_attention_heads=2 * scale,
        caption_channels=text_hidden,
        in_channels=4,
        cross_attention_dim=32 * scale,
        out_channels=8,  # learned sigma: the pipeline keeps the first half
        attention_bias=True,
        activation_fn="gelu-approximate",
        num_embeds_ada_norm=1000,
        norm_type="ada_norm_single",
        norm_elementwise_affine=False,
        norm_eps=1e-6,
    )
    return PixArtSigmaPipeline(
        tokenizer=tokenizer,
        text_encoder=_t5_encoder(tokenizer, text_hidden, text_layers),
        vae=_vae(scale, levels=4, scaling_factor=0.13025),
        transformer=transformer,
        scheduler=DPMSolverMultistepScheduler(),
    )


def _aura_flow(scale: int, text_layers: int):
    from diffusers import AuraFlowPipeline, AuraFlowTransformer2DModel, FlowMatchEulerDiscreteScheduler

    tokenizer = word_tokenizer()
    # AuraFlow's encode_prompt passes the whole tokenizer output to the encoder, which takes no token_type_ids.
    tokenizer.model_input_names = ["input_ids", "attention_mask"]
    text_hidden = 16 * scale
    transformer = AuraFlowTransformer2DModel(
        sample_size=16,
        patch_size=2,
        in_channels=4,
        num_mmdit_layers=1,
        num_single_dit_layers=1,
        attention_head_dim=8,
        num_attention_heads=4 * scale,
        caption_projection_dim=32 * scale,
        joint_attention_dim=text_hidden,
        out_channels=4,
        pos_embed_max_size=256,
    )
    return AuraFlowPipeline(
        tokenizer=tokenizer,
        text_encoder=_t5_encoder(tokenizer, text_hidden, text_layers, "UMT5EncoderModel"),
        vae=_vae(scale),
        transformer=transformer,
        scheduler=FlowMatchEulerDiscreteScheduler(),
    )


def _hidream(scale: int, text_layers: int):
    from diffusers import FlowMatchEulerDiscreteScheduler, HiDreamImagePipeline, HiDreamImageTransformer2DModel
    from transformers import LlamaConfig, LlamaForCausalLM

    # HiDream tokenizes for CLIP to min(max_sequence_length, 218) = 128 tokens.
    clip_hidden = 16 * scale
    t5_tokenizer = word_tokenizer()
    t5_hidden = 16 * scale
    llama_tokenizer = word_tokenizer()
    llama_hidden = 16 * scale
    llama = LlamaForCausalLM(
        LlamaConfig(
            hidden_size=llama_hidden,
            intermediate_size=2 * llama_hidden,
            num_hidden_layers=text_layers,
            num_attention_heads=2,
            num_key_value_heads=2,
            vocab_size=len(llama_tokenizer),
            pad_token_id=llama_tokenizer.eos_token_id,  # HiDreamImagePipeline pads with the eos token
            bos_token_id=llama_tokenizer.bos_token_id,
            eos_token_id=llama_tokenizer.eos_token_id,
        )
    ).eval()
    transformer = HiDreamImageTransformer2DModel(
        patch_size=2,
        in_channels=4,
        out_channels=4,
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=8,
        num_attention_heads=4 * scale,
        caption_channels=[t5_hidden, llama_hidden],
        text_emb_dim=2 * clip_hidden,  # both CLIP projections
        num_routed_experts=4,
        num_activated_experts=2,
        axes_dims_rope=(4, 2, 2),
        max_resolution=(128, 128),  # latent pixels: HiDream runs every request at the area of 128 x 128 latents
        llama_layers=tuple(range(text_layers)),
    )
    return HiDreamImagePipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(),
        vae=_vae(scale, scaling_factor=0.3611, shift_factor=0.1159),
        text_encoder=_clip_text("CLIPTextModelWithProjection", clip_tokenizer(model_max_length=128), clip_hidden,
                                text_layers, projection_dim=clip_hidden),
        tokenizer=clip_tokenizer(model_max_length=128),
        text_encoder_2=_clip_text("CLIPTextModelWithProjection", clip_tokenizer(model_max_length=128), clip_hidden,
                                  text_layers, projection_dim=clip_hidden),
        tokenizer_2=clip_tokenizer(model_max_length=128),
        text_encoder_3=_t5_encoder(t5_tokenizer, t5_hidden, text_layers),
        tokenizer_3=t5_tokenizer,
        text_encoder_4=llama,
        tokenizer_4=llama_tokenizer,
        transformer=transformer,
    )


# Qwen3's chat template as ZImagePipeline applies it (one user turn, then the assistant's turn), in the
# tiny word tokenizer's words.
_QWEN3_CHAT_TEMPLATE = ("{% for message in messages %}im_start {{ message.role }} {{ message.content }} im_end "
                        "{% endfor %}{% if add_generation_prompt %}im_start assistant {% endif %}")


def _zimage(scale: int, text_layers: int):
    from diffusers import FlowMatchEulerDiscreteScheduler, ZImagePipeline, ZImageTransformer2DModel
    from transformers import Qwen3Config, Qwen3Model

    from memfit.testing.tokenizers import DEFAULT_WORDS

    tokenizer = word_tokenizer([*DEFAULT_WORDS, "im_start", "im_end", "user", "assistant"])
    tokenizer.chat_template = _QWEN3_CHAT_TEMPLATE
    text_hidden = 16 * scale
    text_encoder = Qwen3Model(Qwen3Config(
        hidden_size=text_hidden, intermediate_size=2 * text_hidden, num_hidden_layers=text_layers,
        num_attention_heads=2, num_key_value_heads=2, head_dim=8, vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
    )).eval()
    latent_channels = 4
    transformer = ZImageTransformer2DModel(
        all_patch_size=(2,),
        all_f_patch_size=(1,),
        in_channels=latent_channels,
        dim=32 * scale,
        n_layers=2,
        n_refiner_layers=1,
        n_heads=2 * scale,
        n_kv_heads=2 * scale,
        cap_feat_dim=text_hidden,
        axes_dims=[4, 6, 6],  # sums to the head width (dim / n_heads)
        axes_lens=[1024, 64, 64],
    )
    return ZImagePipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(),
        vae=_vae(scale, latent_channels=latent_channels, scaling_factor=0.3611, shift_factor=0.1159,
                 use_quant_conv=False, use_post_quant_conv=False),
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        transformer=transformer,
    )


def _flux2_parts(scale: int, text_hidden: int, *, guidance_embeds: bool):
    """The tiny FLUX.2 transformer and AutoencoderKLFlux2 both FLUX.2 pipelines share. The VAE's batch-norm
    statistics, which the pipelines apply to the latents by hand, are drawn at random (a fresh BatchNorm's
    zero mean and unit variance would leave a missing or doubled application unseen)."""
    from diffusers import AutoencoderKLFlux2, Flux2Transformer2DModel

    latent_channels = 4
    vae = AutoencoderKLFlux2(
        block_out_channels=[16 * scale, 32 * scale],
        down_block_types=["DownEncoderBlock2D"] * 2,
        up_block_types=["UpDecoderBlock2D"] * 2,
        layers_per_block=1,
        latent_channels=latent_channels,
        norm_num_groups=8,
        sample_size=32,
    )
    vae.bn.running_mean.normal_(0.0, 0.5)
    vae.bn.running_var.uniform_(0.5, 2.0)
    transformer = Flux2Transformer2DModel(
        patch_size=1,
        in_channels=4 * latent_channels,  # latents are patchified 2x2
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=16,
        num_attention_heads=2 * scale,
        joint_attention_dim=3 * text_hidden,  # three of the text encoder's hidden layers, stacked
        timestep_guidance_channels=32,
        axes_dims_rope=(4, 4, 4, 4),  # sums to the head width
        guidance_embeds=guidance_embeds,
    )
    return vae, transformer


# Mistral's chat template as Flux2Pipeline applies it (a system turn, then the user's, each a list of text
# parts), in the tiny word tokenizer's words.
_MISTRAL_CHAT_TEMPLATE = ("{% for message in messages %}{{ message.role }} {% for part in message.content %}"
                          "{{ part.text }} {% endfor %}{% endfor %}")


def _flux2(scale: int, text_layers: int):
    """FLUX.2 dev. Its text encoder is a Mistral3ForConditionalGeneration (a Mistral language model with a
    Pixtral vision tower that text-to-image never runs); the pipeline stacks hidden layers 10, 20 and 30, so
    the tiny one has 30 layers, whatever ``text_layers`` asks. The real tokenizer is a PixtralProcessor,
    which needs torchvision to load; the tiny one is a plain tokenizer with a chat template, whose
    apply_chat_template takes the pipeline's call as the processor's does."""
    from diffusers import FlowMatchEulerDiscreteScheduler, Flux2Pipeline
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration, MistralConfig, PixtralVisionConfig

    from memfit.testing.tokenizers import DEFAULT_WORDS

    tokenizer = word_tokenizer([*DEFAULT_WORDS, "system", "user"])
    tokenizer.chat_template = _MISTRAL_CHAT_TEMPLATE
    text_hidden = 16 * scale
    text_encoder = Mistral3ForConditionalGeneration(Mistral3Config(
        text_config=MistralConfig(
            hidden_size=text_hidden, intermediate_size=2 * text_hidden, num_hidden_layers=max(30, text_layers),
            num_attention_heads=2, num_key_value_heads=2, head_dim=8, vocab_size=len(tokenizer),
            pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id, sliding_window=None),
        vision_config=PixtralVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                          num_attention_heads=2, head_dim=8, patch_size=4, image_size=32),
        image_token_index=len(tokenizer) - 1,
        tie_word_embeddings=False,
    )).eval()
    vae, transformer = _flux2_parts(scale, text_hidden, guidance_embeds=True)
    return Flux2Pipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae, text_encoder=text_encoder,
                         tokenizer=tokenizer, transformer=transformer)


def _flux2_klein(scale: int, text_layers: int):
    """FLUX.2 klein (base: guided, not step-distilled). Its Qwen3 text encoder's hidden layers 9, 18 and 27
    are stacked, so the tiny one has 27 layers, whatever ``text_layers`` asks."""
    from diffusers import FlowMatchEulerDiscreteScheduler, Flux2KleinPipeline
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from memfit.testing.tokenizers import DEFAULT_WORDS

    tokenizer = word_tokenizer([*DEFAULT_WORDS, "im_start", "im_end", "user", "assistant"])
    tokenizer.chat_template = _QWEN3_CHAT_TEMPLATE
    text_hidden = 16 * scale
    text_encoder = Qwen3ForCausalLM(Qwen3Config(
        hidden_size=text_hidden, intermediate_size=2 * text_hidden, num_hidden_layers=max(27, text_layers),
        num_attention_heads=2, num_key_value_heads=2, head_dim=8, vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
    )).eval()
    vae, transformer = _flux2_parts(scale, text_hidden, guidance_embeds=False)
    return Flux2KleinPipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae, text_encoder=text_encoder,
                              tokenizer=tokenizer, transformer=transformer, is_distilled=False)


def _sd_pag(scale: int, text_layers: int):
    """A class memfit has no adapter for (SD with perturbed-attention guidance): the generic path."""
    from diffusers import StableDiffusionPAGPipeline

    return StableDiffusionPAGPipeline(**_sd(scale, text_layers).components, pag_applied_layers="mid")


_BUILDERS: dict[str, Callable[[int, int], object]] = {
    "sd": _sd, "sdxl": _sdxl, "lumina2": _lumina2, "cogview4": _cogview4,
    "flux": _flux, "flux_schnell": _flux_schnell, "sd3": _sd3, "qwenimage": _qwenimage,
    "qwenimage_edit": _qwenimage_edit, "qwenimage_edit_plus": _qwenimage_edit_plus, "wan": _wan, "wan22": _wan22,
    "wan22_narrow": _wan22_narrow,
    "wan_i2v": _wan_i2v, "wan22_i2v": _wan22_i2v, "wan22_ti2v": _wan22_ti2v, "chroma": _chroma, "sana": _sana, "pixart_sigma": _pixart_sigma, "aura_flow": _aura_flow, "hidream": _hidream,
    "zimage": _zimage, "flux_kontext": _flux_kontext, "flux_fill": _flux_fill, "flux2": _flux2, "flux2_klein": _flux2_klein,
    "sd_pag": _sd_pag, "hunyuan_image": _hunyuan_image, "hunyuan_video15": _hunyuan_video15, "hunyuan_video15_i2v": _hunyuan_video15_i2v, "ltx": _ltx, "ltx_i2v": _ltx_i2v, "ltx2": _ltx2, "ltx2_i2v": _ltx2_i2v, "sdxl_single_file": _sdxl_single_file, "sd3_single_file": _sd3_single_file, "sd2_single_file": _sd2_single_file,
}

# Sizes each tiny architecture accepts (multiples of what its VAE and patching need).
DEFAULT_SIZE = {"sd": 32, "sdxl": 32, "lumina2": 32, "cogview4": 32, "flux": 32, "flux_schnell": 32, "sd3": 32, "qwenimage": 32, "wan": 32, "wan22": 32, "wan22_narrow": 32, "wan_i2v": 32, "wan22_i2v": 32, "wan22_ti2v": 64, "chroma": 32, "sana": 32, "pixart_sigma": 32, "aura_flow": 32, "hidream": 32,
                "zimage": 32, "flux_kontext": 32, "flux_fill": 32, "flux2": 32, "flux2_klein": 32, "hunyuan_image": 32,
                "hunyuan_video15": 32, "hunyuan_video15_i2v": 32, "ltx": 32, "ltx_i2v": 32, "ltx2": 32, "ltx2_i2v": 32, "qwenimage_edit": 64,
                "qwenimage_edit_plus": 64}


def build_pipeline(kind: str, *, seed: int = 0, scale: int = 1, text_layers: int = 2):
    """A fresh, randomly initialised pipeline of `kind` (one of PIPELINE_KINDS), in eval mode.

    `scale` multiplies every width; `text_layers` sets the depth of the text encoders, so memory
    tests can give each stage a comparable share of the weights.
    """
    if kind not in _BUILDERS:
        raise ValueError(f"unknown tiny pipeline kind {kind!r}; choose one of {', '.join(PIPELINE_KINDS)}")
    torch.manual_seed(seed)
    pipe = _BUILDERS[kind](scale, text_layers)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def save_pipeline(kind: str, path: str | Path, *, seed: int = 0, scale: int = 1, text_layers: int = 2,
                  dtype: torch.dtype | None = None) -> Path:
    """Build a tiny pipeline and save it in the diffusers layout (safetensors) at `path`, its weights in
    ``dtype`` when given (as published checkpoints are: fp16 or bf16 files)."""
    path = Path(path)
    pipe = build_pipeline(kind, seed=seed, scale=scale, text_layers=text_layers)
    if dtype is not None:
        pipe.to(dtype)
    pipe.save_pretrained(path, safe_serialization=True)
    _name_qwen2_vl_processor(pipe, path)
    return path


def _name_qwen2_vl_processor(pipe, path: Path) -> None:
    """A tiny edit pipeline's processor is a Qwen2VLProcessor without its video half (which needs torchvision):
    its saved folder names the class a real Qwen-Image-Edit folder names, transformers' Qwen2VLProcessor."""
    import json

    processor = getattr(pipe, "processor", None)
    if processor is None or type(processor).__name__ != "ImageOnlyQwen2VLProcessor":
        return
    index_file = path / "model_index.json"
    index = json.loads(index_file.read_text(encoding="utf-8"))
    index["processor"] = ["transformers", "Qwen2VLProcessor"]
    index_file.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    config_file = path / "processor" / "processor_config.json"
    config = json.loads(config_file.read_text(encoding="utf-8"))
    config["processor_class"] = "Qwen2VLProcessor"
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
