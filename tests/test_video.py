"""Video output: memfit.generate(...).frames, and the files memfit generate --out writes."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest
from PIL import Image

import memfit
from memfit.errors import MemfitError
from memfit.cli.app import main
from memfit.testing import diffusers_output, max_pixel_difference

PROMPT = "a red circle drifting right"
WAN = ["--steps", "2", "--guidance", "5", "--negative-prompt", "blurry", "--width", "32", "--height", "32",
       "--frames", "5", "--seed", "3", "--quiet"]


@pytest.fixture(scope="module")
def wan_run(tiny_models):
    """One Wan video through the API, and the CLI's arguments for the same video."""
    result = memfit.generate(PROMPT, model=tiny_models("wan"), steps=2, guidance=5.0, negative_prompt="blurry",
                             width=32, height=32, frames=5, seed=3, progress=False)
    return result, ["generate", "--model", tiny_models("wan"), "--prompt", PROMPT, *WAN]


def test_frames_equal_plain_diffusers(tiny_models, wan_run):
    result, _ = wan_run
    assert result.images == [] and len(result.frames) == 5
    assert max_pixel_difference(result.frames, diffusers_output(tiny_models("wan"), result.settings)) == 0
    assert result.metadata["num_frames"] == "5" and result.frames_per_second == 16


def test_frames_is_the_cli_name_of_num_frames(tiny_models):
    # frames= is --frames; num_frames= (diffusers' name) stays the same setting, and two values are refused.
    with pytest.raises(MemfitError, match="frames=5 and num_frames=6 name the same setting"):
        memfit.generate(PROMPT, model=tiny_models("wan"), frames=5, num_frames=6, progress=False)


def test_webp_is_lossless(wan_run, tmp_path):
    result, args = wan_run
    out = tmp_path / "clip.webp"
    assert main([*args, "--out", str(out)]) == 0
    with Image.open(out) as video:
        frames = [np.asarray(frame.convert("RGB")) for frame in _frames(video)]
        assert video.info["duration"] == round(1000 / 16)
    assert len(frames) == 5
    for ours, written in zip(result.frames, frames):
        assert np.array_equal(np.asarray(ours), written)


def test_mp4_holds_every_frame_and_the_settings(wan_run, tmp_path):
    av = pytest.importorskip("av")
    result, args = wan_run
    out = tmp_path / "clip.mp4"
    assert main([*args, "--out", str(out), "--fps", "8"]) == 0
    with av.open(str(out)) as container:
        stream = container.streams.video[0]
        assert stream.average_rate == 8
        metadata = json.loads(container.metadata["comment"])
        frames = [frame.to_ndarray(format="rgb24") for frame in container.decode(stream)]
    assert metadata["prompt"] == PROMPT and metadata["num_frames"] == "5"
    assert len(frames) == 5 and frames[0].shape == (32, 32, 3)
    # H.264 is lossy: close to the frames, and far closer than to another frame.
    errors = [np.abs(np.asarray(ours, dtype=np.int16) - written).mean() for ours, written in zip(result.frames, frames)]
    assert max(errors) < 12, errors


def test_gif_and_first_frame_png(wan_run, tmp_path):
    result, args = wan_run
    gif, png = tmp_path / "clip.gif", tmp_path / "poster.png"
    assert main([*args, "--out", str(gif)]) == 0
    with Image.open(gif) as video:
        assert video.n_frames == 5
        assert json.loads(video.info["comment"])["seed"] == "3"
    assert main([*args, "--out", str(png)]) == 0
    with Image.open(png) as image:
        assert np.array_equal(np.asarray(image.convert("RGB")), np.asarray(result.frames[0]))
        assert image.info["num_frames"] == "5"


def test_missing_pyav_is_said_before_any_work(tiny_models, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "av", None)  # import av raises ImportError
    out = tmp_path / "clip.mp4"
    code = main(["generate", "--model", tiny_models("wan"), "--prompt", PROMPT, *WAN, "--out", str(out)])
    assert code != 0 and not out.exists()
    message = capsys.readouterr().err
    assert "pip install 'memfit[video]'" in message and "Traceback" not in message


def test_an_image_model_refuses_a_video_name(tiny_models, tmp_path, capsys):
    code = main(["generate", "--model", tiny_models("sd"), "--prompt", PROMPT, "--out", str(tmp_path / "x.mp4")])
    assert code != 0
    assert "makes an image; give a file name ending in .png" in capsys.readouterr().err
    result = memfit.generate(PROMPT, model=tiny_models("sd"), steps=1, width=32, height=32, progress=False)
    with pytest.raises(memfit.MemfitError, match="makes images, not a video"):
        result.save(tmp_path / "x.gif")


def test_true_cfg_is_recorded(tiny_models, tmp_path):
    result = memfit.generate(PROMPT, model=tiny_models("flux"), negative_prompt="blurry", true_cfg_scale=2.0, steps=1,
                             width=32, height=32, progress=False)
    with Image.open(result.save(tmp_path / "flux.png")) as image:
        assert image.info["true_cfg_scale"] == "2.0"
        assert "num_frames" not in image.info


def _frames(video):
    for index in range(video.n_frames):
        video.seek(index)
        yield video.copy()
