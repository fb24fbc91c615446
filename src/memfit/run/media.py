"""Writing what a run made to a file: an image as PNG, a video as MP4, WebP or GIF.

Every write is atomic (no partial file is ever left at the path), and each file carries the run's
settings: PNG text chunks, the MP4 container's comment, the GIF comment (as JSON). Animated WebP
and GIF go through Pillow; WebP is lossless, so its frames read back unchanged. MP4 is H.264
through PyAV, the optional extra ``memfit[video]``.

A video with a soundtrack (LTX-2's) carries it in the MP4 as AAC (FFmpeg's own encoder, which PyAV's wheels
bundle) at the waveform's sample rate; WebP and GIF hold no audio, so it is written beside them as a 16-bit WAV
file of the same name (clip.gif and clip.wav).
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


def save_video(frames: list, path: str | Path, frames_per_second: int, metadata: dict[str, str], *,
               audio=None, sample_rate: int | None = None) -> Path:
    """Write PIL frames as a video; the format follows the file's suffix. ``audio``: its soundtrack, a float
    waveform (channels x samples, in [-1, 1]) at ``sample_rate``, in the MP4 or, for WebP and GIF, a WAV beside it."""
    check_video_writer(path)
    if not frames:
        raise MemfitError(f"No frames to write to {path}.")
    suffix = Path(path).suffix.lower()
    if audio is not None:
        audio = _waveform(audio, path, sample_rate)
    if suffix == ".mp4":
        return write_atomically(path, lambda tmp: _write_mp4(frames, tmp, frames_per_second, metadata, audio,
                                                              sample_rate))
    if audio is not None:
        write_atomically(Path(path).with_suffix(".wav"), lambda tmp: _write_wav(audio, tmp, sample_rate))
    duration_ms = round(1000 / frames_per_second)
    options = dict(lossless=True, quality=100) if suffix == ".webp" else dict(comment=json.dumps(metadata))
    return write_atomically(path, lambda tmp: frames[0].save(
        tmp, format=suffix[1:].upper(), save_all=True, append_images=frames[1:], duration=duration_ms, loop=0,
        **options))


def _waveform(audio, path, sample_rate):
    """``audio`` as a float32 numpy array, channels x samples, refusing what no file can carry."""
    import numpy as np

    waveform = np.asarray(audio.detach().cpu().float() if hasattr(audio, "detach") else audio, dtype=np.float32)
    if waveform.ndim == 1:
        waveform = waveform[None]
    if waveform.ndim != 2 or waveform.shape[0] not in (1, 2) or not sample_rate or sample_rate <= 0:
        raise MemfitError(f"{path}: the soundtrack must be mono or stereo samples at a positive sample rate; got "
                          f"shape {tuple(waveform.shape)} at {sample_rate} Hz.")
    return np.ascontiguousarray(np.clip(waveform, -1.0, 1.0))


def _write_wav(waveform, path: str, sample_rate: int) -> None:
    import wave

    import numpy as np

    samples = np.round(waveform.T * 32767).astype("<i2")  # interleaved 16-bit PCM
    with wave.open(path, "wb") as file:
        file.setnchannels(waveform.shape[0])
        file.setsampwidth(2)
        file.setframerate(sample_rate)
        file.writeframes(samples.tobytes())


def _write_mp4(frames: list, path: str, frames_per_second: int, metadata: dict[str, str], audio=None,
               sample_rate: int | None = None) -> None:
    import av

    width, height = frames[0].size
    with av.open(path, mode="w", format="mp4") as container:
        container.metadata["comment"] = json.dumps(metadata)
        stream = container.add_stream("libx264", rate=frames_per_second)
        # yuv420p (what every player decodes) halves the chroma: even sides only.
        stream.width, stream.height = width + width % 2, height + height % 2
        stream.pix_fmt = "yuv420p"
        stream.options = {"crf": "17"}  # visually lossless
        sound = _audio_stream(container, audio, sample_rate) if audio is not None else None  # before any packet
        for frame in frames:
            picture = frame if frame.size == (stream.width, stream.height) else _padded(frame, stream.width, stream.height)
            for packet in stream.encode(av.VideoFrame.from_image(picture.convert("RGB"))):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
        if sound is not None:
            sound()


def _audio_stream(container, waveform, sample_rate: int):
    """Add an AAC stream for ``waveform`` to ``container``; returns what encodes and muxes it."""
    import av

    layout = "mono" if waveform.shape[0] == 1 else "stereo"
    stream = container.add_stream("aac", rate=sample_rate, layout=layout)

    def mux():
        frame = av.AudioFrame.from_ndarray(waveform, format="fltp", layout=layout)
        frame.sample_rate, frame.pts = sample_rate, 0
        for packet in stream.encode(frame):  # the encoder cuts the waveform into AAC's 1024-sample frames itself
            container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)

    return mux


def _padded(frame, width: int, height: int):
    from PIL import Image

    canvas = Image.new("RGB", (width, height))
    canvas.paste(frame, (0, 0))
    return canvas
