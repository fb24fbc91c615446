"""Writing what a run made to a file: an image as PNG, a video as MP4, WebP or GIF.

Every write is atomic (no partial file is ever left at the path), and each file carries the run's
settings: PNG text chunks, the MP4 container's comment, the GIF comment (as JSON). Animated WebP
and GIF go through Pillow; WebP is lossless, so its frames read back unchanged. MP4 is H.264
through PyAV, the optional extra ``memfit[video]``.
"""

from __future__ import annotations

import json
from pathlib import Path

from memfit.atomic import write_atomically
from memfit.errors import MemfitError

__all__ = ["IMAGE_SUFFIXES", "VIDEO_SUFFIXES", "check_video_writer", "png_bytes", "save_png", "save_video"]

IMAGE_SUFFIXES = (".png",)
VIDEO_SUFFIXES = (".mp4", ".webp", ".gif")


def save_png(image, path: str | Path, metadata: dict[str, str]) -> Path:
    """Write a PNG with the run's settings as text chunks."""
    return write_atomically(path, lambda tmp: image.save(tmp, format="PNG", pnginfo=_png_info(metadata)))


def png_bytes(image, metadata: dict[str, str]) -> bytes:
    """The bytes save_png writes for ``image`` and ``metadata``."""
    import io

    buffer = io.BytesIO()
    image.save(buffer, format="PNG", pnginfo=_png_info(metadata))
    return buffer.getvalue()


def _png_info(metadata: dict[str, str]):
    from PIL.PngImagePlugin import PngInfo

    info = PngInfo()
    for key, value in metadata.items():
        info.add_text(key, str(value))
    return info


def check_video_writer(path: str | Path) -> None:
    """Refuse, before any work, a video file this installation cannot write."""
    suffix = Path(path).suffix.lower()
    if suffix not in VIDEO_SUFFIXES:
        raise MemfitError(f"{path}: a video is written as {', '.join(VIDEO_SUFFIXES)} (or .png for its first frame).")
    if suffix == ".mp4":
        try:
            import av  # noqa: F401
        except ImportError:
            raise MemfitError(
                f"Writing {path} needs PyAV, which is not installed: pip install 'memfit[video]' "
                "(or write .webp or .gif, which need nothing more)."
            ) from None


def save_video(frames: list, path: str | Path, frames_per_second: int, metadata: dict[str, str]) -> Path:
    """Write PIL frames as a video; the format follows the file's suffix."""
    check_video_writer(path)
    if not frames:
        raise MemfitError(f"No frames to write to {path}.")
    suffix = Path(path).suffix.lower()
    if suffix == ".mp4":
        return write_atomically(path, lambda tmp: _write_mp4(frames, tmp, frames_per_second, metadata))
    duration_ms = round(1000 / frames_per_second)
    options = dict(lossless=True, quality=100) if suffix == ".webp" else dict(comment=json.dumps(metadata))
    return write_atomically(path, lambda tmp: frames[0].save(
        tmp, format=suffix[1:].upper(), save_all=True, append_images=frames[1:], duration=duration_ms, loop=0,
        **options))


def _write_mp4(frames: list, path: str, frames_per_second: int, metadata: dict[str, str]) -> None:
    import av

    width, height = frames[0].size
    with av.open(path, mode="w", format="mp4") as container:
        container.metadata["comment"] = json.dumps(metadata)
        stream = container.add_stream("libx264", rate=frames_per_second)
        # yuv420p (what every player decodes) halves the chroma: even sides only.
        stream.width, stream.height = width + width % 2, height + height % 2
        stream.pix_fmt = "yuv420p"
        stream.options = {"crf": "17"}  # visually lossless
        for frame in frames:
            picture = frame if frame.size == (stream.width, stream.height) else _padded(frame, stream.width, stream.height)
            for packet in stream.encode(av.VideoFrame.from_image(picture.convert("RGB"))):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)


def _padded(frame, width: int, height: int):
    from PIL import Image

    canvas = Image.new("RGB", (width, height))
    canvas.paste(frame, (0, 0))
    return canvas
