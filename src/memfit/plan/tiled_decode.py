"""diffusers' own tiled decode for the VAEs that decode a whole video (or a very large image) at once: the tiles and
what they hold.

Why: HunyuanVideo 1.5's and LTX-Video's (and LTX-2's) VAEs decode the whole video in one pass, so their widest
activation is every frame at full resolution times the last up block's channels: about 90 GiB estimated for
HunyuanVideo 1.5's default 121 frames at 848x480 in bf16, more than the rest of the run together. diffusers decodes such a video
in overlapping spatial tiles when ``vae.enable_tiling()`` was called, blending each tile's edges into its
neighbours'. That changes the frames (the blend is not the untiled arithmetic), so memfit takes it only where the
untiled decode cannot be planned in the budget at all (a costly strategy, memfit.plan.activations), and then with
the largest tile that fits: the frames equal diffusers' with ``vae.enable_tiling(**DecodeTiling.enable_kwargs)``,
which the run's report names. HunyuanImage 2.1's VAE, which decodes a 2048x2048 image in one pass (about 7.4 GiB in
bf16) and is no AutoencoderKL for memfit's exact banded decode, is tiled the same way.

What a tiled decode holds at its peak: one tile's decoder activations (the shape model of an untiled decode at the
tile's size), every decoded tile (diffusers keeps them all until it blends them; counted tile by tile from the
same loop diffusers runs), and the blended rows beside the output they are joined into (two videos' worth).
"""

from __future__ import annotations

import dataclasses

__all__ = ["DecodeTiling", "TILED_DECODERS", "decode_tilings", "tiled_activation_bytes"]

# The smallest tile side, in latent pixels, memfit asks for: smaller tiles blend over one or two latent pixels,
# and HunyuanVideo 1.5's overlap (three quarters of a tile) is no whole number of latent pixels below 4.
_SMALLEST_LATENT_TILE = 4


@dataclasses.dataclass(frozen=True)
class _TileRule:
    """How a VAE class lays out its tiles: its default tile side (pixels; None: the config's sample_size) and how
    its enable_tiling names them: "stride" (LTX: the tiles' stride), "latent" (HunyuanVideo 1.5: a latent tile
    side beside the pixel one, tiles overlapping by a quarter), "size" (HunyuanImage: one side, a quarter)."""

    default_tile: int | None
    arguments: str

    def stride(self, tile: int, scale: int) -> int:
        """The distance between two tiles' starts, in pixels (a whole number of latent pixels)."""
        if self.arguments == "stride":  # diffusers' default 448 for 512: an eighth blended, at least a latent pixel
            return tile - max(scale, tile // 8 // scale * scale)
        return int(tile // scale * 0.75) * scale

    def latent_tiles(self, default: int) -> list[int]:
        """The latent tile sides to try, largest first: the default, then halves, down to _SMALLEST_LATENT_TILE.
        A quarter-overlap rule needs a multiple of 4 (diffusers' overlap and blend then agree on the seams)."""
        step = 1 if self.arguments == "stride" else 4
        sides, side = [], default // step * step
        while side >= _SMALLEST_LATENT_TILE:
            sides.append(side)
            side = side // 2 // step * step
        return sides


# VAE classes whose decode holds the whole output at full resolution (every frame at once: memfit.plan.meta's
# WHOLE_VIDEO_DECODERS; HunyuanImage 2.1's 2048x2048 image) and whose tiled_decode memfit can ask for.
TILED_DECODERS = {
    "AutoencoderKLHunyuanVideo15": _TileRule(default_tile=256, arguments="latent"),
    "AutoencoderKLLTXVideo": _TileRule(default_tile=512, arguments="stride"),
    "AutoencoderKLLTX2Video": _TileRule(default_tile=512, arguments="stride"),
    "AutoencoderKLHunyuanImage": _TileRule(default_tile=None, arguments="size"),
}


@dataclasses.dataclass(frozen=True)
class DecodeTiling:
    """Square tiles of ``tile`` pixels whose starts are ``stride`` pixels apart, for a VAE of ``vae_class`` that
    scales each latent pixel to ``scale`` pixels."""

    vae_class: str
    tile: int
    stride: int
    scale: int

    @property
    def enable_kwargs(self) -> dict[str, int]:
        """What to pass to the VAE's ``enable_tiling`` for these tiles (diffusers' names for this class)."""
        arguments = TILED_DECODERS[self.vae_class].arguments
        if arguments == "stride":
            return dict(tile_sample_min_height=self.tile, tile_sample_min_width=self.tile,
                        tile_sample_stride_height=self.stride, tile_sample_stride_width=self.stride)
        if arguments == "size":
            return dict(tile_sample_min_size=self.tile)
        # This class keeps its latent tile beside the pixel one; enable_tiling does not derive it.
        return dict(tile_sample_min_height=self.tile, tile_sample_min_width=self.tile,
                    tile_latent_min_height=self.tile // self.scale, tile_latent_min_width=self.tile // self.scale)

    def describe(self) -> str:
        arguments = ", ".join(f"{key}={value}" for key, value in self.enable_kwargs.items())
        return (f"{self.tile}x{self.tile}-pixel tiles {self.stride} apart, blended where they overlap, as diffusers' "
                f"vae.enable_tiling({arguments}) decodes")

    def tile_sides(self, latent_side: int) -> list[int]:
        """The pixel sides of the tiles along one side of ``latent_side`` latent pixels, as diffusers' loop cuts
        them (the last ones may be shorter)."""
        tile, stride = self.tile // self.scale, self.stride // self.scale
        return [min(tile, latent_side - start) * self.scale for start in range(0, latent_side, stride)]


def decode_tilings(vae_class: str, config, scale: int, width: int, height: int) -> list[DecodeTiling]:
    """The tilings memfit may ask a ``vae_class`` VAE (``config``) for at ``width`` x ``height``, largest tile
    first: the class's default tile, then halves of it down to _SMALLEST_LATENT_TILE latent pixels; only tiles
    smaller than the output (a tile it fits in decodes it untiled). None for a class memfit does not tile."""
    rule = TILED_DECODERS.get(vae_class)
    if rule is None or scale <= 0:
        return []
    default = rule.default_tile or int(config.get("sample_size") or 0)
    return [DecodeTiling(vae_class, side * scale, rule.stride(side * scale, scale), scale)
            for side in rule.latent_tiles(default // scale) if width > side * scale or height > side * scale]


def tiled_activation_bytes(tiling: DecodeTiling, config, *, width: int, height: int, frames: int,
                           video_frames: int, dtype: str) -> int:
    """The planned activations of a tiled decode of ``frames`` latent frames into ``video_frames`` frames (1 for an
    image) at ``width`` x ``height``."""
    from memfit.plan.meta import activation_estimate, dtype_bytes

    one_tile = activation_estimate("vae_decoder", config, width=min(tiling.tile, width),
                                   height=min(tiling.tile, height), dtype=dtype, vae_scale=tiling.scale,
                                   class_name=tiling.vae_class, frames=frames)
    pixel_bytes = 3 * video_frames * dtype_bytes(dtype)
    tiles = sum(tiling.tile_sides(height // tiling.scale)) * sum(tiling.tile_sides(width // tiling.scale))
    return one_tile + pixel_bytes * (tiles + 2 * width * height)
