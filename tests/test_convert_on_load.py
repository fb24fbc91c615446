"""Weights stored in another dtype than the run's (fp16 or fp32 files, a bf16 run) are converted block
by block once planned, never the whole model at load: resident blocks are converted in place,
streamed ones at each forward from the memory-mapped file. The image is plain diffusers' at the run
dtype, bitwise."""

import pytest
import torch

import memfit
from memfit.models.folder import ModelFolder
from memfit.run.offload import HookRegistry, SwapHook
from memfit.testing import save_pipeline
from memfit.testing.parity import diffusers_output, max_pixel_difference

from conftest import smallest_budget

SETTINGS = dict(prompt="a red circle", steps=2, guidance=3.5, width=64, height=64, seed=3, dtype="bf16")


@pytest.fixture(scope="module")
def fp16_flux(tmp_path_factory):
    return save_pipeline("flux", tmp_path_factory.mktemp("fp16") / "flux", scale=4, dtype=torch.float16)


def test_folder_reads_the_files_dtype_and_what_it_may_convert(fp16_flux):
    folder = ModelFolder.open(fp16_flux)
    assert folder.file_dtype("transformer") == torch.float16
    assert folder.file_dtype("tokenizer") is None
    assert folder.convertible("transformer", torch.bfloat16)
    assert not folder.convertible("transformer", torch.float16)  # same dtype: nothing to convert
    assert not folder.convertible("text_encoder_2", torch.float16)  # T5 keeps modules in fp32 at fp16


def test_streamed_fp16_files_at_bf16_equal_plain_diffusers(fp16_flux, streamed_plans, monkeypatch, tmp_path):
    monkeypatch.setenv("MEMFIT_CACHE_DIR", str(tmp_path / "cache"))
    budget = smallest_budget(model=str(fp16_flux), **dict(SETTINGS, steps=1))
    streamed_plans.clear()
    loads, fitted = [], []
    original_load = ModelFolder.load_stage
    original_optimize = memfit.run.fit.optimize

    def load_stage(self, names, dtype, device=None, **kwargs):
        loads.append((tuple(names), tuple(kwargs.get("in_file_dtype", ()))))
        pipe = original_load(self, names, dtype, device, **kwargs)
        if "transformer" in names:
            # loaded as views of the fp16 file, not converted
            assert all(p.dtype == torch.float16 for p in pipe.transformer.parameters())
        return pipe

    def optimize(pipe, *args, **kwargs):
        out = original_optimize(pipe, *args, **kwargs)
        if getattr(pipe, "transformer", None) is not None:
            fitted.append(_tiers(pipe.transformer))
        return out

    monkeypatch.setattr(ModelFolder, "load_stage", load_stage)
    monkeypatch.setattr(memfit.run.fit, "optimize", optimize)
    ours = memfit.generate(model=str(fp16_flux), budget=budget, progress=False, **SETTINGS)

    assert any("transformer" in converting for _, converting in loads), loads
    streamed, resident = fitted[0]
    assert streamed and resident  # the plan kept some blocks and streams the others
    assert all(home == torch.float16 and run == torch.bfloat16 for home, run in streamed)
    assert all(dtype == torch.bfloat16 for dtype in resident)
    assert sum(plan.stages[0].streamed_from_disk_bytes for plan in streamed_plans if plan.stages[0].name == "denoise")
    reference = diffusers_output(fp16_flux, ours.settings, dtype=torch.bfloat16)
    assert max_pixel_difference(ours.images, reference) == 0


def _tiers(module):
    """(home dtype, run dtype) of every streamed weight, and the dtype of every other parameter."""
    streamed, hooked_params = [], set()
    for sub in module.modules():
        registry = HookRegistry.get(sub)
        hook = registry.hooks.get(SwapHook.name) if registry is not None else None
        for slot in hook.slots if hook is not None else ():
            if slot.kind == "mmap":
                streamed.append((slot.home_tensor().dtype, slot.dtype))
                hooked_params.add(id(slot.tensor))
    resident = [p.dtype for p in module.parameters() if id(p) not in hooked_params]
    return streamed, resident


def test_restore_gives_back_weights_in_the_run_dtype(fp16_flux):
    folder = ModelFolder.open(fp16_flux)
    pipe = folder.load_stage(["transformer"], torch.bfloat16, in_file_dtype=["transformer"])
    memfit.optimize(pipe, force_tiers={"transformer/transformer_blocks.*": "disk"}, dtype=torch.bfloat16,
                    model_dir=fp16_flux)
    memfit.restore(pipe)
    expected = folder.load_stage(["transformer"], torch.bfloat16).transformer.state_dict()
    for name, tensor in pipe.transformer.state_dict().items():
        assert tensor.dtype == expected[name].dtype and torch.equal(tensor, expected[name]), name


def _file_backed(tensor) -> bool:
    """Whether the tensor's memory lies in a mapping of a .safetensors file (Linux: /proc/self/maps)."""
    address = tensor.untyped_storage().data_ptr()
    for line in open("/proc/self/maps"):
        span, *rest = line.split()
        start, end = (int(x, 16) for x in span.split("-"))
        if start <= address < end:
            return rest[-1].endswith(".safetensors")
    return False


@pytest.fixture(scope="module")
def bf16_flux(tmp_path_factory):
    return save_pipeline("flux", tmp_path_factory.mktemp("bf16") / "flux", scale=4, dtype=torch.bfloat16)


def test_resident_weights_leave_the_page_cache_when_the_stage_streams(bf16_flux):
    """Same-dtype files load as views of the files: page cache, which the kernel reclaims like the
    streamed blocks' pages. When the plan streams from disk, the weights it keeps get memory of their
    own; when nothing streams they stay views (an automatic budget that fits costs nothing)."""
    folder = ModelFolder.open(bf16_flux)
    loaded = folder.load_stage(["transformer"], torch.bfloat16)
    resident_name = "single_transformer_blocks.0.proj_out.weight"
    assert _file_backed(loaded.transformer.get_parameter(resident_name))  # what plain loading leaves
    memfit.optimize(loaded, force_tiers={"transformer/transformer_blocks.*": "disk"}, model_dir=bf16_flux)
    streamed_name = "transformer_blocks.0.attn.to_q.weight"
    assert _file_backed(loaded.transformer.get_parameter(streamed_name))  # the disk tier: the file itself
    assert not _file_backed(loaded.transformer.get_parameter(resident_name))
    assert not any(_file_backed(p) for name, p in loaded.transformer.named_parameters()
                   if not name.startswith("transformer_blocks."))

    whole = folder.load_stage(["transformer"], torch.bfloat16)
    memfit.optimize(whole, force_tiers={"transformer": "device"}, model_dir=bf16_flux)
    assert _file_backed(whole.transformer.get_parameter(resident_name))
