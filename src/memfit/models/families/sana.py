"""SanaPipeline (Gemma-2 text encoder with attention masks, Sana linear-attention DiT, DC-AE VAE).

Sana runs its guidance passes, masks its text and bins its resolution the way PixArt-Sigma does
(memfit.models.families.pixart_sigma: unequal lengths padded with masked zeros, decode resized back
to the requested size), so its adapter is PixArtSigmaAdapter with Sana's VAE scale, patch size and
encode arguments.
"""

from __future__ import annotations

from memfit.models.families.pixart_sigma import PixArtSigmaAdapter


class SanaAdapter(PixArtSigmaAdapter):
    class_name = "SanaPipeline"
    takes_lora = True
    encode_options = ("clean_caption", "max_sequence_length", "complex_human_instruction")

    def vae_scale_factor(self) -> int:
        return 2 ** (len(self.configs["vae"]["encoder_block_out_channels"]) - 1)

    def size_multiple(self) -> int:
        return self.vae_scale_factor() * self.configs["transformer"].get("patch_size", 1)
