"""Wan 2.2 A14B's two experts as ComfyUI keeps them: ``wan2.2_t2v_high_noise_14B_fp16.safetensors`` (transformer, the
high-noise steps) and ``wan2.2_t2v_low_noise_14B_fp16.safetensors`` (transformer_2) in models/diffusion_models/, in
Wan's original keys; the I2V A14B pair likewise. memfit reads them as ``--component transformer=... --component
transformer_2=...`` of a Wan 2.2 folder, as ``--model HIGH --component transformer_2=LOW --config DIR``, and
``memfit serve --models-dir`` lists each pair as one checkpoint, taking of several WanPipeline --config folders (Wan
2.1's and Wan 2.2's) the one whose models are the files'. Each video is the diffusers folder's own, bit for bit.

The tiny models are scale 4 (every transformer tensor a whole number of 64-byte lines), each file's data starting where
its folder's does in a 64-byte line (save_aligned's ``like``), so a weight read in place from a file computes as the
folder's, read in place from its own file, does.
"""

from __future__ import annotations

import json
import shutil
import types
from pathlib import Path

import diffusers
import pytest

import memfit
from memfit.models.library import (
    ModelsDir,
    _config_for,
    config_folders,
    expert_pairs,
    open_entry,
)
from memfit.models.single_file import detect_family, file_shapes
from memfit.testing import max_pixel_difference, save_pipeline
from memfit.testing.conditioning import test_image as picture
from memfit.testing.single_file import (
    save_aligned,
    wan_original_state_dict,
    wan_vae_original_state_dict,
)

# Three steps: the last runs below the boundary (875 of 1000), on the low-noise expert.
VIDEO = dict(prompt="a red circle drifting right", steps=3, seed=3, width=32, height=32, frames=5, budget="none",
             progress=False)


@pytest.fixture(autouse=True)
def no_prompt_cache(monkeypatch):
    monkeypatch.setenv("MEMFIT_CACHE", "0")


@pytest.fixture(autouse=True)
def prompt_cleaning(monkeypatch):
    """diffusers' I2V module calls ftfy without checking it is installed: a stand-in where it is not."""
    from diffusers.pipelines.wan import pipeline_wan_i2v

    if getattr(pipeline_wan_i2v, "ftfy", None) is None:
        monkeypatch.setattr(pipeline_wan_i2v, "ftfy", types.SimpleNamespace(fix_text=lambda text: text), raising=False)


def _configs_only(folder: Path, out: Path) -> Path:
    shutil.copytree(folder, out, ignore=shutil.ignore_patterns("*.safetensors"))
    return out


def _one_expert(folder: Path, out: Path) -> Path:
    """``folder`` (Wan 2.2 A14B) as a Wan 2.1 14B folder: its first expert alone, no boundary."""
    shutil.copytree(folder, out, ignore=shutil.ignore_patterns("transformer_2"))
    index = json.loads((out / "model_index.json").read_text())
    index.update(transformer_2=[None, None], boundary_ratio=None)
    (out / "model_index.json").write_text(json.dumps(index))
    return out


def _weights(folder: Path, name: str) -> Path:
    return next((folder / name).glob("*.safetensors"))


@pytest.fixture(scope="module")
def comfyui(tmp_path_factory):
    """A ComfyUI models folder with the T2V and I2V pairs, the Wan 2.1 VAE and the UMT5 encoder, and beside it the
    diffusers folders they were written from and their configs-only copies."""
    root = tmp_path_factory.mktemp("wan22")
    models = root / "ComfyUI" / "models"
    for sub in ("diffusion_models", "vae", "text_encoders"):
        (models / sub).mkdir(parents=True)
    folders = {"t2v": save_pipeline("wan22_narrow", root / "t2v", seed=0, scale=4),
               "i2v": save_pipeline("wan22_i2v", root / "i2v", seed=0, scale=4)}
    folders["wan21"] = _one_expert(folders["t2v"], root / "wan21")
    files = {}
    for kind in ("t2v", "i2v"):
        pipe = diffusers.DiffusionPipeline.from_pretrained(folders[kind])
        for name, noise in (("transformer", "high"), ("transformer_2", "low")):
            files[kind, name] = save_aligned(wan_original_state_dict(getattr(pipe, name)),
                                             models / "diffusion_models" / f"wan2.2_{kind}_{noise}_noise_14B_fp16.safetensors",
                                             like=_weights(folders[kind], name))
    pipe = diffusers.DiffusionPipeline.from_pretrained(folders["t2v"])
    files["vae"] = save_aligned(wan_vae_original_state_dict(pipe.vae), models / "vae" / "wan_2.1_vae.safetensors",
                                like=_weights(folders["t2v"], "vae"))
    files["text_encoder"] = save_aligned({k: v for k, v in pipe.text_encoder.state_dict().items()
                                          if k != "encoder.embed_tokens.weight"},
                                         models / "text_encoders" / "umt5_xxl_fp16.safetensors",
                                         like=_weights(folders["t2v"], "text_encoder"))
    configs = {kind: _configs_only(folder, root / f"{kind}-configs") for kind, folder in folders.items()}
    return models, folders, configs, files


def test_the_experts_are_paired_by_their_comfyui_names(tmp_path):
    names = ["wan2.2_t2v_high_noise_14B_fp8_scaled.safetensors", "wan2.2_t2v_low_noise_14B_fp8_scaled.safetensors",
             "wan2.2_i2v_high_noise_14B_fp16.safetensors", "wan2.2_i2v_low_noise_14B_fp16.safetensors",
             "Wan2.2-T2V-A14B-HighNoise-Q4_K_M.gguf", "Wan2.2-T2V-A14B-LowNoise-Q4_K_M.gguf",
             "wan2.2_t2v_high_noise_14B_fp16.safetensors",  # its partner is another precision's: not a pair
             "wan2.1_t2v_14B_fp16.safetensors"]
    paths = [tmp_path / name for name in names]
    assert expert_pairs(paths) == {paths[0]: paths[1], paths[2]: paths[3], paths[4]: paths[5]}
    assert expert_pairs([tmp_path / "a" / names[0], tmp_path / "b" / names[1]]) == {}  # one folder only


def test_both_experts_as_components_of_a_wan22_folder(comfyui):
    """--component transformer=HIGH --component transformer_2=LOW on the Wan 2.2 folder: its own video."""
    _, folders, _, files = comfyui
    expected = memfit.generate(model=folders["t2v"], **VIDEO).frames
    ours = memfit.generate(model=folders["t2v"], components={"transformer": files["t2v", "transformer"],
                                                             "transformer_2": files["t2v", "transformer_2"]}, **VIDEO)
    assert ours.report.notes[0] == (f"components from files of their own: transformer from {files['t2v', 'transformer']} "
                                    f"(Wan layout), transformer_2 from {files['t2v', 'transformer_2']} (Wan layout)")
    assert max_pixel_difference(ours.frames, expected) == 0
    swapped = memfit.generate(model=folders["t2v"], components={"transformer": files["t2v", "transformer_2"],
                                                                "transformer_2": files["t2v", "transformer"]}, **VIDEO)
    assert max_pixel_difference(swapped.frames, expected) > 0  # each expert runs
    # --model HIGH --config DIR (configs only) with every other model from a file of its own: the same video.
    ours = memfit.generate(model=files["t2v", "transformer"], config=comfyui[2]["t2v"],
                           components={name: files["t2v", "transformer_2"] if name == "transformer_2" else files[name]
                                       for name in ("transformer_2", "vae", "text_encoder")}, **VIDEO)
    assert max_pixel_difference(ours.frames, expected) == 0


def test_a_models_folder_lists_each_pair_as_one_checkpoint_with_the_config_that_fits(comfyui, tmp_path):
    """Two WanPipeline --config folders, Wan 2.2's first: the pair takes Wan 2.2's (two experts), a lone expert of the
    same shapes Wan 2.1's (one); the low-noise file is not listed alone. Each draws its diffusers folder's video."""
    models, folders, configs, files = comfyui
    lone = models.parent.parent / "lone" / "models"
    for sub in ("diffusion_models", "vae", "text_encoders"):
        (lone / sub).mkdir(parents=True)
    (lone / "diffusion_models" / "wan2.1_t2v_14B_fp16.safetensors").symlink_to(files["t2v", "transformer"])
    for name in ("vae", "text_encoder"):
        (lone / ("vae" if name == "vae" else "text_encoders") / files[name].name).symlink_to(files[name])
    given = config_folders([configs["t2v"], configs["i2v"], configs["wan21"]])
    entries = {entry.path: entry for entry in ModelsDir(models, configs=given).scan().checkpoints}
    assert set(entries) == {files["t2v", "transformer"], files["i2v", "transformer"]}
    pair = entries[files["t2v", "transformer"]]
    assert pair.error == "" and pair.pipeline == "WanPipeline", pair.error
    assert pair.name == "diffusion_models/wan2.2_t2v_high_noise_14B_fp16.safetensors"
    assert dict(pair.components) == {"transformer_2": files["t2v", "transformer_2"], "vae": files["vae"],
                                     "text_encoder": files["text_encoder"]}
    assert entries[files["i2v", "transformer"]].pipeline == "WanImageToVideoPipeline"
    model = open_entry(pair, configs=given)
    assert model.config_dir == configs["t2v"]
    assert max_pixel_difference(memfit.generate(model=model, **VIDEO).frames,
                                memfit.generate(model=folders["t2v"], **VIDEO).frames) == 0

    single = ModelsDir(lone, configs=given).scan().checkpoints[0]
    assert single.error == "" and "transformer_2" not in dict(single.components), single.error
    model = open_entry(single, configs=given)
    assert model.config_dir == configs["wan21"]
    assert max_pixel_difference(memfit.generate(model=model, **VIDEO).frames,
                                memfit.generate(model=folders["wan21"], **VIDEO).frames) == 0


def test_a_config_of_other_widths_is_passed_over(comfyui, tiny_models):
    """Of two WanPipeline --config folders, the file takes the one whose transformer has its shapes, whichever is
    given first (the tiny 1.3B-like folder is narrower than these experts)."""
    _, _, configs, files = comfyui
    narrow = Path(tiny_models("wan"))
    given = config_folders([narrow, configs["wan21"]])
    assert _config_for(files["t2v", "transformer"], given) == configs["wan21"]
    # Neither has a second expert: the one the file fits still, so opening it says the second expert has no place.
    assert _config_for(files["t2v", "transformer"], given, {"transformer_2": files["t2v", "transformer_2"]}) \
        == configs["wan21"]
    assert _config_for(files["t2v", "transformer"], config_folders([narrow, configs["i2v"]])) == narrow  # no fit: first


def test_the_i2v_pair_runs_as_wan_image_to_video(comfyui):
    """Wan 2.2 I2V A14B's experts (36 input channels, no image embedder): WanImageToVideoPipeline's family, and
    the pair with an input image draws the folder's video."""
    _, folders, _, files = comfyui
    high = files["i2v", "transformer"]
    family = detect_family(high, file_shapes(high))
    assert (family.model_type, family.pipeline_class) == ("wan2.2-i2v-A14B", "WanImageToVideoPipeline")
    settings = dict(VIDEO, steps=2, image=picture(32, seed=1))  # the boundary is 900: the second step is the low expert's
    expected = memfit.generate(model=folders["i2v"], **settings).frames
    ours = memfit.generate(model=high, config=folders["i2v"], components={"transformer_2": files["i2v", "transformer_2"]},
                           **settings)
    assert ours.metadata["pipeline"] == "WanImageToVideoPipeline"
    assert max_pixel_difference(ours.frames, expected) == 0


def test_a_lone_expert_with_a_two_expert_config_names_the_flag(comfyui):
    """The high-noise file alone with Wan 2.2's configs only: refused, naming --component transformer_2=FILE."""
    from memfit.errors import MemfitError

    _, _, configs, files = comfyui
    with pytest.raises(MemfitError, match="--component transformer_2=FILE"):
        memfit.generate(model=files["t2v", "transformer"], config=configs["t2v"],
                        components={"vae": files["vae"], "text_encoder": files["text_encoder"]}, **VIDEO)


def test_a_pair_without_config_takes_wan22s_configs_from_the_hugging_face_cache(comfyui, tmp_path, monkeypatch):
    """No --config: the high-noise file with a transformer_2 beside it takes the configs of Wan 2.2 A14B's repository
    from the Hugging Face cache (the file's width alone would say Wan 2.1's); a lone file still names Wan 2.1's."""
    from memfit.errors import MemfitError
    from memfit.models.single_file import FAMILIES
    from memfit.models.single_file_configs import default_repository

    models, folders, configs, files = comfyui
    family = FAMILIES["wan-t2v-1.3B"]
    repository = default_repository(family, paired=True)
    assert repository == "Wan-AI/Wan2.2-T2V-A14B-Diffusers" != default_repository(family)
    cache = tmp_path / "hf" / "hub" / f"models--{repository.replace('/', '--')}"
    snapshot = Path(shutil.copytree(configs["t2v"], cache / "snapshots" / ("0" * 40)))
    (cache / "refs").mkdir()
    (cache / "refs" / "main").write_text(snapshot.name)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    others = {"vae": files["vae"], "text_encoder": files["text_encoder"]}
    ours = memfit.generate(model=files["t2v", "transformer"],
                           components={"transformer_2": files["t2v", "transformer_2"], **others}, **VIDEO)
    assert f"configs and tokenizers from the Hugging Face cache's snapshot of {repository}" in ours.report.notes[0]
    assert max_pixel_difference(ours.frames, memfit.generate(model=folders["t2v"], **VIDEO).frames) == 0
    with pytest.raises(MemfitError, match="Wan-AI/Wan2.1-T2V-1.3B-Diffusers"):
        memfit.generate(model=files["t2v", "transformer"], components=others, **VIDEO)
    # serve --models-dir with no --config: the pair is listed, its configs from the cache.
    pair = next(entry for entry in ModelsDir(models).scan().checkpoints if entry.path == files["t2v", "transformer"])
    assert pair.error == "" and pair.pipeline == "WanPipeline", pair.error


@pytest.mark.slow  # starts a server process
def test_the_pair_is_served_as_memfit_generate_draws_it(comfyui, memfit_server):
    """memfit serve --models-dir over the ComfyUI folder with Wan 2.1's and Wan 2.2's --config folders: the pair is one
    listed checkpoint (the low-noise file not listed alone), and a txt2img request naming it gives the image `memfit
    generate --model HIGH --component transformer_2=LOW ...` makes (txt2img asks Wan for one frame)."""
    import base64

    httpx = pytest.importorskip("httpx", reason="the server is polled with httpx: pip install 'memfit[serve]'")
    from memfit.run.media import png_bytes

    models, _, configs, files = comfyui
    flags = ["--config", str(configs["wan21"]), "--config", str(configs["t2v"]), "--config", str(configs["i2v"])]
    with memfit_server(None, "--models-dir", str(models), *flags) as (_, url):
        listed = {c["name"]: c for c in httpx.get(url + "/memfit/v1/models", timeout=60).json()["checkpoints"]}
        name = "diffusion_models/wan2.2_t2v_high_noise_14B_fp16.safetensors"
        assert not listed[name]["error"] and listed[name]["kind"] == "split", listed[name]
        assert not any("low_noise" in listed_name for listed_name in listed)
        body = {"prompt": VIDEO["prompt"], "steps": 3, "cfg_scale": 1.0, "width": 32, "height": 32, "seed": 3,
                "sampler_name": "Euler", "override_settings": {"sd_model_checkpoint": name}}
        answer = httpx.post(url + "/sdapi/v1/txt2img", json=body, timeout=600)
    assert answer.status_code == 200, answer.text
    result = memfit.generate(body["prompt"], model=files["t2v", "transformer"], config=configs["t2v"],
                             components={"transformer_2": files["t2v", "transformer_2"], "vae": files["vae"],
                                         "text_encoder": files["text_encoder"]},
                             steps=3, guidance=1.0, width=32, height=32, seed=3, sampler="Euler", frames=1,
                             progress=False)
    assert base64.b64decode(answer.json()["images"][0]) == png_bytes(result.frames[0], result.metadata)
