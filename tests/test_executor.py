"""The executor: optimize() on a live pipeline gives plain diffusers' bits, with real weights always.

Each test runs the plain pipeline first, then optimizes the *same* object and runs again with the
same seed (the assert_matches_diffusers idea, without reloading). Plans are forced so that every
tier (device, host, disk) holds blocks of every component kind.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

import memfit
from memfit.run.executor import optimize, restore
from memfit.run.offload import REGISTRY_ATTR

TIERS = {
    "sd": {
        "text_encoder/encoder.layers.0": "disk",
        "text_encoder/encoder.layers.1": "host",
        "unet/down_blocks.*": "disk",
        "unet/mid_block.*": "disk",
        "unet/up_blocks.*": "host",
        "vae/decoder.*": "disk",
        "vae/rest": "host",
    },
    "lumina2": {
        "text_encoder/layers.*": "disk",
        "text_encoder/rest": "host",
        "transformer/layers.*": "disk",
        "transformer/noise_refiner.*": "host",
        "vae/decoder.*": "disk",
    },
}
DISK_PARAM = {  # (component, parameter) inside a disk-tier block
    "sd": ("unet", "down_blocks.0.resnets.0.conv1.weight"),
    "lumina2": ("text_encoder", "layers.0.mlp.down_proj.weight"),
}


def load(folder, dtype=torch.float32):
    import diffusers

    pipe = diffusers.DiffusionPipeline.from_pretrained(folder, torch_dtype=dtype)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def generate(pipe, seed=0):
    return pipe(
        prompt="a lighthouse at dusk",
        negative_prompt="fog",
        num_inference_steps=2,
        guidance_scale=4.0,
        width=32,
        height=32,
        generator=torch.Generator("cpu").manual_seed(seed),
        output_type="np",
    ).images


def modules_of(pipe):
    return {n: m for n, m in pipe.components.items() if isinstance(m, torch.nn.Module)}


def snapshot(pipe):
    out = {}
    for name, module in modules_of(pipe).items():
        for key, t in list(module.named_parameters()) + list(module.named_buffers()):
            out[f"{name}.{key}"] = (t, t.detach().clone(), t.dtype, t.device)
    return out


def assert_same_bits(a, b):
    assert a.shape == b.shape and np.array_equal(a, b), f"max difference {np.abs(a - b).max()}"


def mapped_files():
    """(start, end, path) of every file-backed mapping of this process."""
    out = []
    with open("/proc/self/maps") as handle:
        for line in handle:
            parts = line.split(maxsplit=5)
            if len(parts) == 6:
                start, end = (int(x, 16) for x in parts[0].split("-"))
                out.append((start, end, parts[5].strip()))
    return out


@pytest.mark.parametrize("kind", ["sd", "lumina2"])
def test_every_tier_matches_plain_diffusers_bitwise(tiny_models, kind):
    pipe = load(tiny_models(kind))
    plain = generate(pipe)
    before = snapshot(pipe)

    assert optimize(pipe, force_tiers=TIERS[kind]) is pipe
    plan = pipe._memfit_plan
    wheres = {p.where for stage in plan.stages for p in stage.placements}
    assert wheres == {"device", "host", "disk"}
    assert_same_bits(generate(pipe), plain)
    assert_same_bits(generate(pipe), plain)  # a second run (learned order) too

    # Disk-tier weights on the CPU ARE the mapped file: other storage, mapped from the model folder.
    component, name = DISK_PARAM[kind]
    param = pipe.components[component].get_parameter(name)
    assert param is before[f"{component}.{name}"][0]
    ptr = param.untyped_storage().data_ptr()
    assert ptr != before[f"{component}.{name}"][1].untyped_storage().data_ptr()
    hits = [path for start, end, path in mapped_files() if start <= ptr < end]
    assert hits and hits[0].endswith(".safetensors") and f"/{kind}/{component}/" in hits[0], hits

    restore(pipe)
    assert_same_bits(generate(pipe), plain)


def _fake_gpu_cases():
    for kind in TIERS:
        for lazy in (True, False):
            for prefetch in (True, False):
                quick = kind == "sd" and lazy and prefetch  # the quick tier keeps one; `make test` runs all
                yield pytest.param(kind, lazy, prefetch, marks=() if quick else pytest.mark.slow,
                                   id=f"{kind}-{'lazy' if lazy else 'eager'}-{'prefetch' if prefetch else 'no-prefetch'}")


@pytest.mark.parametrize("kind, lazy, prefetch", _fake_gpu_cases())
def test_every_tier_on_a_fake_gpu_matches_plain_diffusers_bitwise(tiny_models, kind, lazy, prefetch):
    """The same every-tier plans on "cuda" through the fake CUDA runtime (memfit.testing.fake_cuda):
    device copies, pinned host arena, disk through the staging ring, prefetch on a side stream.
    Lazy: no copy completes before something waits for it, so a missing wait changes the image."""
    from memfit.testing.fake_cuda import fake_cuda

    pipe = load(tiny_models(kind))
    plain = generate(pipe)
    with fake_cuda(lazy=lazy) as gpu:
        optimize(pipe, force_tiers=TIERS[kind], device="cuda", prefetch=prefetch)
        try:
            gpu.pageable_copy_bytes = 0
            assert_same_bits(generate(pipe), plain)
            assert_same_bits(generate(pipe), plain)  # a second run (learned order, prefetch by it) too
            assert gpu.pageable_copy_bytes == 0  # every streamed copy is from pinned memory
        finally:
            restore(pipe)
        assert gpu.pinned_bytes() == 0
    assert_same_bits(generate(pipe), plain)


def test_bf16_run_from_fp32_files_converts_block_by_block(tiny_models):
    """Run dtype differs from the file's: each disk block is converted just before its forward
    (prefetched on a thread), the mapped fp32 view is its home outside, and bits still match."""
    pipe = load(tiny_models("sd"), torch.bfloat16)
    plain = generate(pipe)
    optimize(pipe, force_tiers=TIERS["sd"])
    param = pipe.unet.get_parameter(DISK_PARAM["sd"][1])
    assert param.dtype == torch.float32  # the mapped file's own dtype, real data
    assert pipe.unet.dtype == torch.bfloat16  # the anchor parameter keeps module.dtype right
    assert_same_bits(generate(pipe), plain)
    assert_same_bits(generate(pipe), plain)
    assert param.dtype == torch.float32  # swapped back after the forward
    restore(pipe)
    assert param.dtype == torch.bfloat16
    assert_same_bits(generate(pipe), plain)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_parts_a_stage_does_not_run_stay_on_disk(tiny_models, dtype):
    """A text-to-image decode runs the VAE's decoder half: only it is planned; the encoder half is put
    on the disk tier (the mapped file, nothing in memory), and both halves still compute plain's bits."""
    from memfit.models.families.base import VAE_DECODE_PARTS
    from memfit.run.executor import blocks_not_run, live_blocks, unrun_blocks

    pipe = load(tiny_models("sd"), dtype)
    plain = generate(pipe)
    pixels = torch.rand(1, 3, 32, 32, generator=torch.Generator().manual_seed(1), dtype=dtype) * 2 - 1
    plain_latents = pipe.vae.encode(pixels).latent_dist.mean
    encoder_weight = pipe.vae.encoder.down_blocks[0].resnets[0].conv1.weight
    before = encoder_weight.detach().clone()

    parts = {"vae": VAE_DECODE_PARTS}
    optimize(pipe, stage="generate", parts=parts)  # budget auto: the tiny model fits whole
    placed = {f"{p.component}/{p.block}": p.bytes for stage in pipe._memfit_plan.stages for p in stage.placements}
    assert any(key.startswith("vae/decoder.") for key in placed) and "vae/rest" in placed
    # Of the encoder only the VAE's anchor (its first parameter, kept in place whatever its block's tier) is planned.
    anchor = next(pipe.vae.parameters())
    encoder = {key: size for key, size in placed.items() if key.startswith("vae/encoder")}
    assert list(encoder.values()) == [anchor.numel() * anchor.element_size()], encoder
    assert all(p.where == "device" for stage in pipe._memfit_plan.stages for p in stage.placements)
    assert {b.key.split(".")[0] for b in blocks_not_run(pipe)} == {"vae/encoder"}
    ptr = encoder_weight.untyped_storage().data_ptr()
    hits = [path for start, end, path in mapped_files() if start <= ptr < end]
    assert hits and hits[0].endswith(".safetensors") and "/vae/" in hits[0], hits

    assert_same_bits(generate(pipe), plain)
    assert torch.equal(pipe.vae.encode(pixels).latent_dist.mean, plain_latents)  # streamed in when called
    restore(pipe)
    assert encoder_weight.dtype == dtype and torch.equal(encoder_weight, before)
    assert blocks_not_run(pipe) == []

    # Parts that name no block of the component (another VAE class) leave the whole component planned.
    blocks = {"vae": live_blocks("vae", pipe.vae)}
    assert unrun_blocks(blocks, {"vae": ("no_such_module",)}) == []
    assert {b.name.split(".")[0] for b in unrun_blocks(blocks, parts)} == {"encoder"}


def test_item_on_offloaded_weight_outside_forward(tiny_models):
    """Failure 1 (Lumina2 / Gemma2): reading an offloaded weight outside a forward sees real data."""
    pipe = load(tiny_models("lumina2"))
    component, name = DISK_PARAM["lumina2"]
    expected = pipe.text_encoder.get_parameter(name)[0, 1].item()
    optimize(pipe, force_tiers=TIERS["lumina2"])
    weight = pipe.text_encoder.get_parameter(name)
    assert not weight.is_meta and weight.device.type == "cpu"
    assert weight[0, 1].item() == expected
    generate(pipe)
    assert pipe.text_encoder.get_parameter(name)[0, 1].item() == expected
    assert all(not p.is_meta for m in modules_of(pipe).values() for p in m.parameters())
    restore(pipe)


def test_to_and_deepcopy_after_optimize(tiny_models):
    """Failure 3: .to() and copy.deepcopy keep working on an optimized pipeline."""
    pipe = load(tiny_models("sd"))
    plain = generate(pipe)
    optimize(pipe, force_tiers=TIERS["sd"])
    assert pipe.to("cpu") is pipe
    twin = copy.deepcopy(pipe)
    assert_same_bits(generate(twin), plain)
    assert_same_bits(generate(pipe), plain)
    # The copy has its own parameters and hooks; restoring it leaves the original optimized.
    assert twin.unet.conv_in.weight is not pipe.unet.conv_in.weight
    restore(twin)
    assert not any(REGISTRY_ATTR in vars(m) for m in twin.unet.modules())
    assert_same_bits(generate(twin), plain)
    assert_same_bits(generate(pipe), plain)
    restore(pipe)


def test_bf16_deepcopy_keeps_hooks_working(tiny_models):
    pipe = load(tiny_models("sd"), torch.bfloat16)
    plain = generate(pipe)
    optimize(pipe, force_tiers=TIERS["sd"])
    twin = copy.deepcopy(pipe)
    assert any(REGISTRY_ATTR in vars(m) for m in twin.unet.modules())
    assert_same_bits(generate(twin), plain)
    restore(twin)
    assert_same_bits(generate(twin), plain)
    restore(pipe)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_restore_leaves_no_trace(tiny_models, dtype):
    pipe = load(tiny_models("sd"), dtype)
    before = snapshot(pipe)
    hook_counts = {
        (n, i): (len(m._forward_pre_hooks), len(m._forward_hooks))
        for n, c in modules_of(pipe).items()
        for i, m in enumerate(c.modules())
    }
    pipe_attrs = set(vars(pipe))
    # diffusers itself may leave fp32 weights mapped from the files it loaded; memfit's own
    # mappings are the ones that appear after optimize, and no restored tensor may live in them.
    loaded_maps = {(s, e) for s, e, path in mapped_files() if path.endswith(".safetensors")}
    optimize(pipe, force_tiers=TIERS["sd"])
    memfit_maps = {(s, e) for s, e, path in mapped_files() if path.endswith(".safetensors")} - loaded_maps
    assert memfit_maps
    assert any(REGISTRY_ATTR in vars(m) for m in pipe.unet.modules())  # disk blocks convert or release pages
    restore(pipe)

    assert set(vars(pipe)) == pipe_attrs
    for n, c in modules_of(pipe).items():
        for i, m in enumerate(c.modules()):
            assert (len(m._forward_pre_hooks), len(m._forward_hooks)) == hook_counts[(n, i)]
            assert "forward" not in vars(m)
            assert not [a for a in vars(m) if a.startswith("_memfit")]
    after = snapshot(pipe)
    assert after.keys() == before.keys()
    for key, (tensor, value, dtype_, device) in before.items():
        now = after[key][0]
        assert now is tensor, key
        assert now.dtype == dtype_ and now.device == device, key
        assert torch.equal(now, value), key
        assert not any(s <= now.untyped_storage().data_ptr() < e for s, e in memfit_maps), key


def test_plans_from_budget_and_bad_input(tiny_models):
    pipe = load(tiny_models("sd"))
    optimize(pipe, memfit.Budget(device="1GiB"))  # the tiny model fits whole
    assert pipe._memfit_plan.stages and not any(
        p.where != "device" for s in pipe._memfit_plan.stages for p in s.placements
    )
    with pytest.raises(memfit.MemfitError, match="already optimized"):
        optimize(pipe)
    restore(pipe)
    with pytest.raises(memfit.MemfitError, match="match no block"):
        optimize(pipe, force_tiers={"unet/nope": "disk"})
    assert not hasattr(pipe, "_memfit_plan")
