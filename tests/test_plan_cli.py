"""`memfit plan` through an argparse parser built here, on built-in archs and on a tiny folder."""

from __future__ import annotations

import argparse
import json

import pytest

from memfit.cli.plan import register
from memfit.plan.stages import choose_strategies, stage_options
from memfit.models.archs import get_arch
from memfit.plan.budget import Budget
from memfit.sizes import parse_size
from memfit.errors import MemfitError
from memfit.plan.meta import measure_component

# The figures below are the plans' own: the memory this process holds is counted by the tests that say so.
pytestmark = pytest.mark.usefixtures("nothing_in_use")


def run(argv, capsys):
    parser = argparse.ArgumentParser(prog="memfit")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["plan", *argv])
    code = args.func(args)
    return code, capsys.readouterr().out


def run_json(argv, capsys):
    code, out = run([*argv, "--json"], capsys)
    assert code == 0
    return json.loads(out)


def test_sdxl_table_fits_the_budget(capsys):
    code, out = run(["--arch", "sdxl", "--budget", "4GiB"], capsys)
    assert code == 0
    for word in ("encode", "denoise", "decode", "unet", "text_encoder_2", "vae", "peak"):
        assert word in out


def test_sdxl_json_places_every_measured_block_within_budget(capsys):
    report = run_json(["--arch", "sdxl", "--budget", "4GiB", "--dtype", "bf16", "--device", "cuda"], capsys)
    plan = report["plan"]
    assert all(stage["peak_bytes"] <= 4 * 2**30 for stage in plan["stages"])
    unet = get_arch("sdxl").component("unet")
    measured = measure_component("unet", unet.library, unet.class_name, unet.config, "bf16")
    denoise = next(s for s in plan["stages"] if s["name"] == "denoise")
    assert sum(p["bytes"] for p in denoise["placements"]) == measured.total_bytes
    assert {p["where"] for p in denoise["placements"]} == {"device", "host"}  # 4.8 GiB UNet: partial


def test_plan_defaults_to_the_dtype_generate_runs_in(capsys):
    from memfit.cli.app import build_parser

    generate_default = build_parser().parse_args(["generate"]).dtype
    assert run_json(["--arch", "sd15", "--budget", "8GiB"], capsys)["dtype"] == generate_default == "fp32"


def test_bigger_budget_keeps_more_resident(capsys):
    def resident(budget):
        plan = run_json(["--arch", "sd15", "--budget", budget, "--width", "512", "--height", "512"], capsys)["plan"]
        return next(s for s in plan["stages"] if s["name"] == "denoise")["resident_bytes"]

    assert resident("1GiB") < resident("1.5GiB") <= resident("8GiB")


def test_fp16_upcasts_a_force_upcast_vae(capsys):
    def decode_bytes(dtype):
        plan = run_json(["--arch", "sdxl", "--budget", "8GiB", "--dtype", dtype], capsys)["plan"]
        return next(s for s in plan["stages"] if s["name"] == "decode")["resident_bytes"]

    assert decode_bytes("fp16") == decode_bytes("fp32") == 2 * decode_bytes("bf16")


def test_strategies_are_chosen_as_a_run_chooses_them(capsys):
    """SD 1.5 fp32 at 512x512: a roomy budget decodes the plain way; at 1 GiB the plain decode
    (about 1 GiB of activations) would push the VAE off the device, so the plan shows the banded one,
    with its smaller activations; chunked attention, then split guidance, only where the batched
    denoise cannot be planned."""
    def planned(budget):
        report = run_json(["--arch", "sd15", "--dtype", "fp32", "--budget", budget], capsys)
        stages = {s["name"]: s for s in report["plan"]["stages"]}
        return report["strategies"], stages

    roomy, roomy_stages = planned("8GiB")
    assert roomy == {"encode": "plain", "denoise": "batched", "decode": "plain"}
    tight, tight_stages = planned("1GiB")
    assert tight["decode"] == "banded" and tight["denoise"] == "batched"
    assert tight_stages["decode"]["activation_bytes"] < 0.75 * roomy_stages["decode"]["activation_bytes"]
    _, out = run(["--arch", "sd15", "--dtype", "fp32", "--budget", "1GiB"], capsys)
    assert "decode: banded instead of plain" in out

    # The denoise alone: 600 MiB cannot hold the batched pass (270 MiB) beside two streamed 188 MiB
    # blocks; the chunked pass (224 MiB) fits, and is chosen before split. 560 MiB holds only the
    # split pass (165 MiB).
    options = stage_options(get_arch("sd15").adapter(), dtype="fp32", width=512, height=512)
    denoise = [stage for stage in options if stage[0][1].name == "denoise"]
    stages, chosen = choose_strategies(denoise, Budget(device="600MiB"))
    assert chosen["denoise"].name == "chunked"
    assert stages[0].activation_bytes < roomy_stages["denoise"]["activation_bytes"]
    smaller, chosen = choose_strategies(denoise, Budget(device="560MiB"))
    assert chosen["denoise"].name == "split"
    assert smaller[0].activation_bytes < stages[0].activation_bytes


def test_too_small_budget_raises_with_the_smallest_that_works(capsys):
    with pytest.raises(MemfitError, match="smallest budget that works"):
        run(["--arch", "flux", "--budget", "256MiB"], capsys)


def test_bad_budget_string_raises(capsys):
    with pytest.raises(MemfitError, match="4 gigs"):
        run(["--arch", "sd15", "--budget", "4 gigs"], capsys)


def test_unknown_arch_is_an_argparse_error(capsys):
    with pytest.raises(SystemExit):
        run(["--arch", "sd3", "--budget", "4GiB"], capsys)


# --- --model DIR -----------------------------------------------------------------------------

TINY = {
    "unet": {
        "_class_name": "UNet2DConditionModel",
        "block_out_channels": [4, 8],
        "layers_per_block": 1,
        "sample_size": 32,
        "in_channels": 4,
        "out_channels": 4,
        "down_block_types": ["DownBlock2D", "CrossAttnDownBlock2D"],
        "up_block_types": ["CrossAttnUpBlock2D", "UpBlock2D"],
        "cross_attention_dim": 32,
        "norm_num_groups": 2,
    },
    "vae": {
        "_class_name": "AutoencoderKL",
        "block_out_channels": [4, 8],
        "down_block_types": ["DownEncoderBlock2D", "DownEncoderBlock2D"],
        "up_block_types": ["UpDecoderBlock2D", "UpDecoderBlock2D"],
        "latent_channels": 4,
        "norm_num_groups": 2,
    },
    "text_encoder": {
        "model_type": "clip_text_model",
        "hidden_size": 32,
        "intermediate_size": 37,
        "num_attention_heads": 4,
        "num_hidden_layers": 5,
        "vocab_size": 1000,
        "max_position_embeddings": 77,
    },
}
INDEX = {
    "_class_name": "StableDiffusionPipeline",
    "_diffusers_version": "0.42.1",
    "unet": ["diffusers", "UNet2DConditionModel"],
    "vae": ["diffusers", "AutoencoderKL"],
    "text_encoder": ["transformers", "CLIPTextModel"],
    "tokenizer": ["transformers", "CLIPTokenizer"],
    "scheduler": ["diffusers", "PNDMScheduler"],
    "safety_checker": [None, None],
    "image_encoder": ["transformers", "CLIPVisionModelWithProjection"],
}


@pytest.fixture
def tiny_pipeline(tmp_path):
    (tmp_path / "model_index.json").write_text(json.dumps(INDEX))
    for name, config in TINY.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(config))
    return tmp_path


def test_model_folder_is_planned_from_configs_alone(tiny_pipeline, capsys):
    report = run_json(["--model", str(tiny_pipeline), "--budget", "1GiB"], capsys)
    stages = {s["name"]: s for s in report["plan"]["stages"]}
    assert {p["component"] for p in stages["encode"]["placements"]} == {"text_encoder"}
    assert {p["component"] for p in stages["denoise"]["placements"]} == {"unet"}
    assert all(p["block"].startswith("decoder") or p["block"] == "rest" for p in stages["decode"]["placements"])
    assert report["width"] == 32 * 2  # sample_size x the tiny VAE's 2x downscale
    unet = measure_component("unet", "diffusers", "UNet2DConditionModel", TINY["unet"], "fp32")
    assert stages["denoise"]["resident_bytes"] == unet.total_bytes


def test_model_folder_table_mentions_models_it_leaves_out(tiny_pipeline, capsys):
    code, out = run(["--model", str(tiny_pipeline), "--budget", "1GiB"], capsys)
    assert code == 0
    assert "not planned: image_encoder" in out


def test_missing_model_index_names_the_file(tmp_path, capsys):
    with pytest.raises(MemfitError, match="model_index.json"):
        run(["--model", str(tmp_path), "--budget", "1GiB"], capsys)


def test_missing_component_config_names_the_file(tiny_pipeline, capsys):
    (tiny_pipeline / "vae" / "config.json").unlink()
    with pytest.raises(MemfitError, match=r"vae.config\.json"):
        run(["--model", str(tiny_pipeline), "--budget", "1GiB"], capsys)


def test_broken_json_names_the_file_and_line(tiny_pipeline, capsys):
    (tiny_pipeline / "unet" / "config.json").write_text('{"block_out_channels": [4, 8],\n oops}')
    with pytest.raises(MemfitError, match=r"unet.config\.json is not valid JSON \(line 2"):
        run(["--model", str(tiny_pipeline), "--budget", "1GiB"], capsys)


def test_host_and_disk_flags_reach_the_planner(capsys):
    report = run_json(["--arch", "flux", "--budget", "8GiB", "--host", "16GiB", "--disk", "/var/tmp/mf", "--device",
                       "cuda"], capsys)
    plan = report["plan"]
    assert plan["budget"] == {"device": 8 * 2**30, "host": parse_size("16GiB"), "disk": "/var/tmp/mf"}
    assert plan["host_peak_bytes"] <= 16 * 2**30
    assert any(home == "disk" for _key, home in plan["homes"])


def test_the_json_plan_replays_through_optimize_with_plain_diffusers_bits(tiny_models, tmp_path, capsys):
    """What `memfit plan --json` prints, as a dict and as a file, is a plan optimize carries out."""
    from test_executor import assert_same_bits, generate, load

    from memfit.plan.planner import Plan
    from memfit.run.executor import optimize, restore

    model = tiny_models("sd")
    size = ["--model", model, "--width", "32", "--height", "32", "--steps", "2"]
    roomy = {s["name"]: s for s in run_json([*size, "--budget", "1GiB", "--device", "cuda"],
                                            capsys)["plan"]["stages"]}["denoise"]
    # Half the UNet fits beside the denoise activations; a tenth of it on the host, the rest on disk (a GPU's
    # tiers: on the CPU a run streams from the model's files, with no host tier).
    weights = roomy["resident_bytes"]
    report = run_json([*size, "--budget", str(roomy["activation_bytes"] + weights // 2), "--host", str(weights // 10),
                       "--disk", str(tmp_path), "--device", "cuda"], capsys)
    assert {p["where"] for s in report["plan"]["stages"] for p in s["placements"]} == {"device", "host", "disk"}
    saved = tmp_path / "plan.json"
    saved.write_text(json.dumps(report))

    pipe = load(model)
    plain = generate(pipe)
    for plan in (report, str(saved)):
        optimize(pipe, plan=plan)
        assert pipe._memfit_plan == Plan.from_dict(report["plan"])
        assert_same_bits(generate(pipe), plain)
        restore(pipe)
    saved.write_text(json.dumps({key: value for key, value in report["plan"].items() if key != "stages"}))
    with pytest.raises(MemfitError, match=r"plan\.json: The plan's 'stages' is missing"):
        optimize(pipe, plan=saved)
    saved.write_text("{")
    with pytest.raises(MemfitError, match=r"plan\.json is not JSON"):
        optimize(pipe, plan=saved)


def test_plan_and_generate_agree_on_a_cpu(tiny_models, monkeypatch, capsys):
    """On the CPU a plan counts the memory the process holds before any weight, as a run does (the
    process's figure fixed here, as --process-memory fixes it), refuses a budget below the run's floor
    with the run's own message and streams from the model's files, not from a host tier."""
    import memfit
    from memfit.devices import DeviceRuntime
    from memfit.plan.budget import BudgetTooSmall

    held = 300 * 2**20
    monkeypatch.setattr(DeviceRuntime, "memory_in_use", lambda self: held)
    model = tiny_models("sd")
    size = ["--model", model, "--width", "64", "--height", "64", "--steps", "2"]
    with pytest.raises(BudgetTooSmall) as planned:
        run([*size, "--budget", str(held + 2**20)], capsys)
    with pytest.raises(BudgetTooSmall) as generated:
        memfit.generate("a red circle", model=model, width=64, height=64, steps=2, budget=held + 2**20,
                        device="cpu", progress=False)
    assert str(planned.value) == str(generated.value)
    assert "for this process" in str(planned.value)

    needed = planned.value.needed
    report = run_json([*size, "--budget", str(needed)], capsys)
    assert report["process_bytes"] == held and report["device"] == "cpu"
    assert report["plan"]["budget"]["device"] == needed - held and report["plan"]["budget"]["host"] == 0
    assert {p["where"] for s in report["plan"]["stages"] for p in s["placements"]} <= {"device", "disk"}
    fixed = run_json([*size, "--budget", str(needed), "--process-memory", "0"], capsys)
    assert fixed["process_bytes"] == 0 and fixed["plan"]["budget"]["device"] == needed


# The 2025-26 families at real size and their default sizes and frames (a decode too large untiled runs in tiles:
# tests/test_tiled_decode.py).
REAL_SIZE_FAMILIES = {"flux-fill": [], "qwen-image": [], "qwen-image-edit": [], "qwen-image-edit-plus": [],
                      "hunyuanimage2.1": [], "wan2.2-a14b": [],
                      "wan2.2-i2v-a14b": [], "wan2.2-ti2v-5b": [], "ltx-video": [], "ltx2": [], "hunyuanvideo1.5": []}


@pytest.mark.parametrize("arch", sorted(REAL_SIZE_FAMILIES))
def test_the_newer_families_plan_at_real_size_in_6_12_and_24_gib(arch, capsys):
    from memfit.models.families import ADAPTERS

    adapter = get_arch(arch).adapter()
    assert type(adapter) is ADAPTERS[get_arch(arch).class_name]
    streamed = []
    for budget in ("6GiB", "12GiB", "24GiB"):
        report = run_json(["--arch", arch, "--budget", budget, "--dtype", "bf16", "--process-memory", "0",
                           *REAL_SIZE_FAMILIES[arch]], capsys)
        stages = report["plan"]["stages"]
        assert all(stage["peak_bytes"] <= parse_size(budget) for stage in stages), budget
        assert {stage["name"].split(":")[0] for stage in stages} == {"encode", "denoise", "decode"}
        streamed.append(sum(p["bytes"] for stage in stages for p in stage["placements"] if p["where"] != "device"))
    assert streamed[0] >= streamed[1] >= streamed[2] and streamed[0] > 0  # more room, less streamed


def test_a_video_plan_takes_its_frames(capsys):
    """HunyuanVideo 1.5 decodes every frame at once, as its pipeline does: 33 frames decode untiled in 24 GiB, its
    default 121 frames only in tiles. An image family has no --frames."""
    code, out = run(["--arch", "hunyuanvideo1.5", "--budget", "24GiB", "--dtype", "bf16", "--frames", "33"], capsys)
    assert code == 0 and "33 frames" in out and "decode: plain (the pipeline's own way)" in out
    code, out = run(["--arch", "hunyuanvideo1.5", "--budget", "24GiB", "--dtype", "bf16"], capsys)
    assert code == 0 and "121 frames" in out and "decode: tiled instead of plain" in out
    with pytest.raises(MemfitError, match="leave --frames out"):
        run(["--arch", "flux-fill", "--budget", "24GiB", "--frames", "5"], capsys)
