"""AUTOMATIC1111's extras upscaling (/sdapi/v1/extra-single-image) with the upscalers that need no
model: "Lanczos" and "Nearest" resize with Pillow, "None" leaves the image as it is (A1111 does the
same: its extras upscale step is skipped when upscaler_1 is "None").

The sizes follow A1111's: "scale by" multiplies both sides, "scale to" scales by the larger of the
two ratios; the result is rounded down to a multiple of 8 (a second, Lanczos, resize where the first
did not land on it), and "scale to" with crop centres it on a black canvas of exactly the size asked.
"""

from __future__ import annotations

import dataclasses

from PIL import Image

from memfit.errors import MemfitError

__all__ = ["UPSCALERS", "Upscale", "upscale"]

# A1111's upscaler name -> Pillow's filter (None: no upscaling).
UPSCALERS = {"None": None, "Lanczos": Image.Resampling.LANCZOS, "Nearest": Image.Resampling.NEAREST}


@dataclasses.dataclass(frozen=True)
class Upscale:
    """What to do, in A1111's terms: ``mode`` 0 scales by ``by``, 1 to ``width`` x ``height`` (cropped
    to exactly that size with ``crop``); ``second`` is blended in with weight ``second_visibility``."""

    upscaler: str
    mode: int
    by: float
    width: int
    height: int
    crop: bool
    second: str
    second_visibility: float

    def check(self, image_size: tuple[int, int], max_pixels: int) -> None:
        """Refuse, naming the field, what cannot be done or would make more than ``max_pixels``."""
        for field, name in (("upscaler_1", self.upscaler), ("upscaler_2", self.second)):
            if name not in UPSCALERS:
                raise MemfitError(f"{field} {name!r} is not an upscaler memfit has; use one of: "
                                  f"{', '.join(UPSCALERS)}.")
        if self.upscaler == "None":
            return
        if self.mode == 1 and (self.width < 1 or self.height < 1):
            raise MemfitError("upscaling_resize_w and upscaling_resize_h must be positive, got "
                              f"{self.width}x{self.height}.")
        scale = self.scale_for(*image_size)
        first, final = _sizes(*image_size, scale)
        if final[0] < 1 or final[1] < 1:
            raise MemfitError(f"Scaling {image_size[0]}x{image_size[1]} by {scale:g} leaves no pixels (the result is "
                              "rounded down to a multiple of 8); raise upscaling_resize.")
        largest = max(first[0] * first[1], final[0] * final[1], self.width * self.height if self.crops else 0)
        if largest > max_pixels:
            raise MemfitError(f"The upscaled image would have {largest} pixels, more than the {max_pixels} a "
                              "request may make; scale less (memfit serve --max-pixels raises the limit).")

    @property
    def crops(self) -> bool:
        return self.mode == 1 and self.crop

    def scale_for(self, width: int, height: int) -> float:
        """The factor an image of ``width`` x ``height`` is scaled by."""
        return max(self.width / width, self.height / height) if self.mode == 1 else self.by


def _sizes(width: int, height: int, scale: float) -> tuple[tuple[int, int], tuple[int, int]]:
    """(size of the upscaler's own resize, size of the result before any crop)."""
    return (int(width * scale), int(height * scale)), (int(width * scale // 8 * 8), int(height * scale // 8 * 8))


def _resized(image: Image.Image, resample, scale: float) -> Image.Image:
    first, final = _sizes(image.width, image.height, scale)
    # The upscaler runs unless the image is already at least the final size (scale 1 still runs once).
    if image.width < final[0] or image.height < final[1] or scale == 1:
        image = image.resize(first, resample=resample)
    return image if image.size == final else image.resize(final, resample=Image.Resampling.LANCZOS)


def upscale(image: Image.Image, job: Upscale) -> tuple[Image.Image, dict[str, str]]:
    """``image`` upscaled as ``job`` (which passed ``job.check``) says, and A1111's "Postprocess ..." notes."""
    image = image if image.mode in ("RGB", "RGBA") else image.convert("RGB")
    if job.upscaler == "None":
        return image, {}
    scale = job.scale_for(image.width, image.height)
    notes = {"Postprocess upscale to": f"{job.width}x{job.height}"} if job.mode == 1 else \
        {"Postprocess upscale by": str(job.by)}

    def one(upscaler: str) -> Image.Image:
        result = _resized(image, UPSCALERS[upscaler], scale)
        if job.crops:
            canvas = Image.new("RGB", (job.width, job.height))
            canvas.paste(result, box=(job.width // 2 - result.width // 2, job.height // 2 - result.height // 2))
            notes["Postprocess crop to"] = f"{job.width}x{job.height}"
            result = canvas
        return result

    result = one(job.upscaler)
    notes["Postprocess upscaler"] = job.upscaler
    if job.second != "None" and job.second_visibility > 0:
        second = one(job.second)
        result = Image.blend(result, second.convert(result.mode), job.second_visibility)
        notes["Postprocess upscaler 2"] = job.second
    return result, notes
