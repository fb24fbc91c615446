"""memfit's GPU path, run on the fake CUDA runtime (memfit.testing.fake_cuda) on the CPU.

Each test names the defect of issue 14 it guards (2: the anchor parameter, 3: one pinned arena and
a host budget, 4: blocks in flight, 6: the disk tier through a pinned ring, 9: compiled graphs), or
the item of issue 34 (the second review; its page-locking calls are in test_cuda_pinning.py), and
where a fix is a wait or a bound, the test also removes it once and shows the fake notices.
The every-tier, every-family parity runs through the fake are in test_executor.py and
test_families.py.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch

import memfit
from memfit.run import offload
from memfit.run.executor import live_blocks, optimize, restore
from memfit.run.offload import ALIGNMENT, HookRegistry, SwapHook
from memfit.testing.fake_cuda import fake_cuda
from test_executor import TIERS, generate, load, modules_of

HOST_ONLY = {"text_encoder/*": "host", "unet/*": "host", "vae/*": "host"}
MIXED = {"text_encoder/*": "disk", "unet/*": "host", "vae/*": "host"}
ALL_DISK = {"text_encoder/*": "disk", "unet/*": "disk", "vae/*": "disk"}


def hooks_of(pipe) -> list[SwapHook]:
    return [HookRegistry.get(module).hooks[SwapHook.name] for module in pipe._memfit_state.hooked]


def nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def largest_streamed_block(pipe) -> int:
    return max(sum(nbytes(slot.tensor) for slot in hook.slots) for hook in hooks_of(pipe))


@pytest.fixture(scope="module")
def sd(tiny_models):
    pipe = load(tiny_models("sd"))
    return pipe, generate(pipe)


@pytest.mark.slow  # a generation on the fake GPU; the quick tier keeps two cheaper cases
def test_anchor_is_on_the_device_and_the_run_never_mixes_devices(sd):
    """Defect 2: each component's first parameter (module.device reads it) is moved to the GPU and
    stays there, and every weight a module computes with is in device memory during its forward."""
    pipe, plain = sd
    anchors = {name: next(module.parameters()) for name, module in modules_of(pipe).items()}
    with fake_cuda(lazy=True) as gpu:
        optimize(pipe, force_tiers=TIERS["sd"], device="cuda")
        assert all(gpu.owns(anchor) for anchor in anchors.values())
        off_device = []

        def check(module, args):
            for name, tensor in list(module.named_parameters(recurse=False)) + list(module.named_buffers(recurse=False)):
                if not gpu.owns(tensor):
                    off_device.append(f"{type(module).__name__}.{name}")

        handles = [sub.register_forward_pre_hook(check) for m in modules_of(pipe).values() for sub in m.modules()]
        try:
            assert np.array_equal(generate(pipe), plain)
        finally:
            for handle in handles:
                handle.remove()
            restore(pipe)
        assert not off_device, off_device[:5]
        assert all(not gpu.owns(anchor) and anchor.device.type == "cpu" for anchor in anchors.values())


def test_one_exact_pinned_arena_per_stage_released_on_restore(sd):
    """Defect 3: the host tier lives in ONE pinned arena per optimize call, exactly the planned
    host bytes plus alignment, filled from the model's files, and given back by restore."""
    pipe, plain = sd
    with fake_cuda() as gpu:
        optimize(pipe, force_tiers=HOST_ONLY, device="cuda", stage="generate")
        plan = pipe._memfit_plan
        anchors = sum(nbytes(next(m.parameters())) for m in modules_of(pipe).values())
        host_slots = [slot for hook in hooks_of(pipe) for slot in hook.slots if slot.kind == "host"]
        planned = plan.host_peak_bytes - anchors  # the anchors are on the device (defect 2)
        assert sum(nbytes(slot.tensor) for slot in host_slots) == planned
        assert len(gpu.pinned_arenas()) == 1
        assert planned <= gpu.pinned_bytes() < planned + ALIGNMENT * len(host_slots)
        assert np.array_equal(generate(pipe), plain)
        assert gpu.pageable_copy_bytes > 0  # the device tier moved once at optimize; nothing else below
        restore(pipe)
        assert gpu.pinned_bytes() == 0 and gpu.pinned_arenas() == []
        assert np.array_equal(generate(pipe), plain)


@pytest.mark.slow  # a generation on the fake GPU; the quick tier keeps two cheaper cases
def test_host_arena_is_read_from_the_files_not_the_loaded_copy(sd, monkeypatch):
    """Defect 3: a host-tier weight that is in the model's files is copied into the arena from the
    memory map; the loaded tensor is only the source of what no file holds."""
    pipe, plain = sd
    copies = []  # (destination, source) storage addresses
    original = torch.Tensor.copy_

    def spying(self, source, *args, **kwargs):
        copies.append((self.data_ptr(), source.untyped_storage().data_ptr()))
        return original(self, source, *args, **kwargs)

    loaded = {t.untyped_storage().data_ptr() for t in pipe.unet.parameters()}
    with fake_cuda():
        monkeypatch.setattr(torch.Tensor, "copy_", spying)
        optimize(pipe, force_tiers={"unet/*": "host"}, device="cuda")
        monkeypatch.undo()
        try:
            (arena,) = pipe._memfit_state.arenas
            begin, end = arena.data_ptr(), arena.data_ptr() + arena.numel()
            into_arena = [source for destination, source in copies if begin <= destination < end]
            assert len(into_arena) == sum(len(hook.slots) for hook in hooks_of(pipe))
            assert not loaded & set(into_arena)
            assert np.array_equal(generate(pipe), plain)
        finally:
            restore(pipe)


@pytest.mark.slow  # a generation on the fake GPU; the quick tier keeps two cheaper cases
def test_host_budget_is_bounded_and_honored(sd, tmp_path):
    """Defect 3: on a GPU the host tier is page-locked RAM: an explicit device-only budget gets a
    host budget (available RAM minus a reserve), never "unlimited", and a given one is honored."""
    from memfit.plan.budget import read_host_memory

    pipe, plain = sd
    total = sum(b.bytes for name, m in modules_of(pipe).items() for b in live_blocks(name, m))
    with fake_cuda() as gpu:
        optimize(pipe, memfit.Budget(device="1GiB"), device="cuda")
        host = pipe._memfit_plan.budget.host
        assert host is not None and 0 < host <= read_host_memory().available
        restore(pipe)

        host_budget = total // 4
        optimize(pipe, memfit.Budget(device=total // 2, host=host_budget, disk=str(tmp_path)), device="cuda",
                 activation_bytes=0)  # a tiny model: the activations at its default size would not leave it room
        plan = pipe._memfit_plan
        wheres = {p.where for stage in plan.stages for p in stage.placements}
        assert {"host", "disk"} <= wheres, wheres
        assert plan.host_peak_bytes <= host_budget
        ring = pipe._memfit_state.runtime.ring
        arenas = gpu.pinned_arenas()
        assert ring is not None and len(arenas) == 2  # the host tier's, the disk tier's staging ring
        assert arenas[0] <= plan.host_peak_bytes + ALIGNMENT * sum(len(h.slots) for h in hooks_of(pipe))
        assert np.array_equal(generate(pipe), plain)
        restore(pipe)
        assert gpu.pinned_bytes() == 0


def test_a_stage_budget_on_a_gpu_bounds_the_host_tier():
    """Defect 3, the staged runner's way in: a stage's budget on a GPU (memfit.plan.budget.stage_budget, which
    the runner and optimize share) bounds the host tier by what the host has; on the CPU a budget's host part
    is taken as given, and a stage streaming from its files parks nothing in host RAM."""
    from memfit.devices import runtime_for
    from memfit.plan.budget import read_host_memory, stage_budget

    with fake_cuda():
        host = stage_budget(memfit.Budget(device="1GiB"), runtime_for("cuda")).host
    assert host is not None and 0 < host <= read_host_memory().available
    assert stage_budget(memfit.Budget(device="1GiB"), runtime_for("cpu")).host is None
    assert stage_budget(memfit.Budget(device="1GiB"), runtime_for("cpu"), stream_from="/models/x").host == 0


@pytest.mark.slow  # a generation on the fake GPU; the quick tier keeps two cheaper cases
def test_blocks_in_flight_are_bounded(sd):
    """Defect 4: with a "GPU" that never runs ahead (lazy), freed blocks stay reserved until the host
    has synchronized an event after their forward. Streamed blocks run in the window's slots (BlockSlots), whose
    reuse the device orders, so reserved memory stays within resident + window x the largest streamed block,
    however far the host runs ahead."""
    pipe, plain = sd

    def peak_over_bound():
        with fake_cuda(lazy=True) as gpu:
            optimize(pipe, force_tiers=MIXED, device="cuda")
            try:
                window = pipe._memfit_state.runtime.window
                assert window == 1 + pipe._memfit_plan.prefetch
                bound = gpu.memory_allocated() + window * largest_streamed_block(pipe)
                gpu.reset_peak_memory_stats()
                image = generate(pipe)
                return gpu.max_memory_reserved(), bound, image
            finally:
                restore(pipe)

    peak, bound, image = peak_over_bound()
    assert peak <= bound, (peak, bound)
    assert np.array_equal(image, plain)


@pytest.mark.slow  # two generations on the fake GPU, twice
@pytest.mark.parametrize("lazy", [True, False], ids=["lazy", "eager"])
def test_disk_tier_streams_through_the_pinned_ring(sd, lazy):
    """Defect 6: on a GPU a disk-tier block is read from its file into a pinned staging ring (the
    plan's window of slots) by the reader thread and copied from there: no pageable copy while it
    runs, and the image is plain diffusers' bits."""
    pipe, plain = sd
    with fake_cuda(lazy=lazy) as gpu:
        optimize(pipe, force_tiers=ALL_DISK, device="cuda")
        try:
            runtime = pipe._memfit_state.runtime
            assert runtime.ring is not None
            mapped = [[s for s in hook.slots if s.kind == "mmap"] for hook in hooks_of(pipe)]
            largest = max(sum(-(-nbytes(s.home_tensor()) // ALIGNMENT) * ALIGNMENT for s in slots) for slots in mapped)
            assert runtime.ring.arena.numel() == runtime.window * largest
            gpu.pageable_copy_bytes = 0
            assert np.array_equal(generate(pipe), plain)
            assert np.array_equal(generate(pipe), plain)
            assert gpu.pageable_copy_bytes == 0
        finally:
            restore(pipe)


@pytest.mark.slow  # a generation on the fake GPU; the quick tier keeps two cheaper cases
def test_the_fake_catches_a_missing_wait(sd, monkeypatch):
    """With the compute stream no longer waiting for the prefetch copies, a lazy fake GPU hands the
    forward tensors that were never filled: the image changes (it would pass on a CPU-only run)."""
    pipe, plain = sd
    with fake_cuda(lazy=True) as gpu:
        optimize(pipe, force_tiers=TIERS["sd"], device="cuda")
        try:
            generate(pipe)  # the first pass learns the order; the second prefetches by it
            monkeypatch.setattr(gpu.current_stream(), "wait_event", lambda event: None)
            broken = generate(pipe)
        finally:
            monkeypatch.undo()
            restore(pipe)
    assert not np.array_equal(broken, plain)


def test_cuda_graph_modes_are_refused_while_weights_stream(sd):
    """Defect 9: inductor's CUDA-graph modes replay captured addresses; streamed weights move on
    every forward, so optimize refuses them (and leaves the pipeline as it was)."""
    from memfit.compile.backends.inductor import InductorBackend, uses_cuda_graphs
    from memfit.compile.entry_points import compile_components, uncompile

    class Graphed(InductorBackend):
        default_options = {**InductorBackend.default_options, "mode": "reduce-overhead"}

    assert uses_cuda_graphs({"mode": "max-autotune"}) and not uses_cuda_graphs({"mode": "max-autotune-no-cudagraphs"})
    assert uses_cuda_graphs({"inductor_config": {"triton.cudagraphs": True}}) and not uses_cuda_graphs({})
    pipe, _ = sd
    with fake_cuda():
        with pytest.raises(memfit.MemfitError, match="streams its weights, which CUDA graphs cannot follow"):
            optimize(pipe, force_tiers={"unet/up_blocks.*": "host"}, device="cuda", backend=Graphed())
        assert not hasattr(pipe, "_memfit_plan") and not any(offload.REGISTRY_ATTR in vars(m) for m in pipe.unet.modules())
        # Compiled first (as the staged runner does), optimized after: refused the same way.
        compile_components(pipe, {"unet": Graphed()}, cache=False)
        try:
            with pytest.raises(memfit.MemfitError, match="unet.forward streams its weights"):
                optimize(pipe, force_tiers={"unet/up_blocks.*": "host"}, device="cuda")
            optimize(pipe, force_tiers={"vae/*": "host"}, device="cuda")  # the compiled unet stays resident
            restore(pipe)
        finally:
            uncompile(pipe)


@pytest.mark.slow  # dynamo traces the tiny UNet three times
def test_hooks_break_compiled_graphs_only_at_their_boundaries(tiny_models, monkeypatch):
    """Defect 9: the hook dispatch is torch.compiler.disable'd, so dynamo stops at a streamed
    module's entry and exit instead of tracing into the swap and breaking inside it. Measured on
    the tiny SD UNet streamed from disk on the CPU (torch._dynamo.explain of unet.forward; torch
    2.13): 0 breaks without memfit, 33 with memfit's hooks traced into, 25 with them disabled,
    for 49 hooked modules (2 boundaries each at most)."""
    pipe = load(tiny_models("sd"))
    unet = pipe.unet
    sample = torch.randn(1, unet.config.in_channels, 4, 4)
    context = torch.randn(1, 7, unet.config.cross_attention_dim)

    def breaks():
        torch._dynamo.reset()
        return torch._dynamo.explain(unet.forward)(sample, torch.tensor([10]), context).graph_break_count

    def streamed_breaks():
        optimize(pipe, force_tiers={"unet/*": "disk"})
        try:
            return breaks(), len(pipe._memfit_state.hooked)
        finally:
            restore(pipe)
            torch._dynamo.reset()

    assert breaks() == 0
    disabled, hooked = streamed_breaks()
    # The hooks as they were before: dispatch traced into (registered bound, so patched before optimize).
    monkeypatch.setattr(HookRegistry, "_pre", HookRegistry._pre.__wrapped__)
    monkeypatch.setattr(HookRegistry, "_post", HookRegistry._post.__wrapped__)
    traced, _ = streamed_breaks()
    assert 0 < disabled <= 2 * hooked
    assert disabled < traced, (disabled, traced)


# --- issue 34: the GPU path's second review ------------------------------------------------------------


def unet_inputs(unet):
    generator = torch.Generator().manual_seed(0)
    sample = torch.randn(1, unet.config.in_channels, 4, 4, generator=generator)
    return sample, torch.tensor([10]), torch.randn(1, 7, unet.config.cross_attention_dim, generator=generator)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_a_pipeline_loaded_in_inference_mode_streams_from_disk_with_prefetch(tiny_models, device):
    """Issue 34, item 1: the reader thread makes a block's run form in the modes of the thread that started the
    prefetch (and in inference mode for weights that are inference tensors). A pipeline loaded and optimized
    under torch.inference_mode(), as servers do, failed at its first prefetched block with "Inference tensors
    do not track version counter", on the CPU (a converted disk tier) and on the GPU path; and one loaded in
    inference mode but run under no_grad failed at its first block."""
    gpu = fake_cuda(lazy=True) if device == "cuda" else contextlib.nullcontext()
    with gpu, torch.inference_mode():
        pipe = load(tiny_models("sd"))
        # on the CPU only a block converted to another dtype is made on the reader thread
        dtype = torch.bfloat16 if device == "cpu" else None
        optimize(pipe, force_tiers={"unet/down_blocks.*": "disk", "unet/up_blocks.*": "host"}, device=device,
                 dtype=dtype)
        try:
            inputs = unet_inputs(pipe.unet)
            inputs = tuple(t.to(dtype) if dtype and t.is_floating_point() else t for t in inputs)
            first = pipe.unet(*inputs).sample  # prefetches in the plan's order, learns the order run
            again = pipe.unet(*inputs).sample  # every streamed block after the first comes from a prefetch
            with torch.inference_mode(False), torch.no_grad():
                outside = pipe.unet(*inputs).sample
        finally:
            restore(pipe)
    assert torch.equal(first, again) and torch.equal(first, outside)


def test_a_dropped_pipeline_gives_its_pinned_memory_back_only_after_the_copies_that_read_it(tiny_models):
    """Issue 34, item 2: the learned order wraps around (the last streamed block prefetches the first), so when
    a stage ends a copy from the pinned arenas is still queued. A pipeline dropped without restore (a staged
    run's finished stage) used to unregister and free its arenas under that copy; now its finalizer waits for
    the reader thread and the device first, and drops the prefetched block with its device memory."""
    import gc

    with fake_cuda(lazy=True) as gpu:
        pipe = load(tiny_models("sd"))
        optimize(pipe, force_tiers={"unet/down_blocks.*": "disk", "unet/up_blocks.*": "host"}, device="cuda")
        with torch.inference_mode():
            pipe.unet(*unet_inputs(pipe.unet))
            pipe.unet(*unet_inputs(pipe.unet))  # its last block prefetched the first for a next forward
        assert gpu.pinned_bytes() > 0
        del pipe
        gc.collect()
        assert gpu.released_while_read == 0
        assert gpu.pinned_bytes() == 0 and gpu.memory_allocated() == 0  # the queued copy ran, its block was dropped


def test_the_plan_host_figure_counts_the_disk_tier_staging_ring(sd, tmp_path):
    """Issue 34, item 7: on a GPU the disk tier passes through a pinned staging ring in host RAM; the plan's host
    figure counts it, so what is page-locked stays within the plan and the host budget (here the ring pushed it
    past both)."""
    pipe, _ = sd
    total = sum(b.bytes for name, m in modules_of(pipe).items() for b in live_blocks(name, m))
    host_budget = total // 16
    with fake_cuda() as gpu:
        optimize(pipe, memfit.Budget(device=total // 2, host=host_budget, disk=str(tmp_path)), device="cuda",
                 activation_bytes=0)
        try:
            plan = pipe._memfit_plan
            runtime = pipe._memfit_state.runtime
            assert runtime.ring is not None and plan.host_peak_bytes <= host_budget
            # the ring's slots also align each tensor (the plan counts weights alone)
            alignment = runtime.window * ALIGNMENT * max(len(hook.slots) for hook in hooks_of(pipe))
            assert gpu.pinned_bytes() <= min(plan.host_peak_bytes + alignment, host_budget)
        finally:
            restore(pipe)


def test_optimize_called_directly_plans_the_activations_a_staged_run_would(sd, tiny_models):
    """Issue 34, item 10: memfit.optimize on a pipeline planned no room for activations (activation_bytes=0)
    unless told; now each stage reserves its family's estimate at the pipeline's default size with guidance,
    with the GPU margin, the same figures the staged runner plans from the model's folder."""
    from memfit.models.families.base import Settings
    from memfit.models.folder import ModelFolder
    from memfit.plan.activations import DEVICE_ACTIVATION_MARGIN, stage_strategies

    pipe, _ = sd
    with fake_cuda():
        optimize(pipe, memfit.Budget(device="1GiB"), device="cuda")
        planned = {stage.name: stage.activation_bytes for stage in pipe._memfit_plan.stages}
        restore(pipe)
    adapter = ModelFolder.open(tiny_models("sd")).adapter
    size = adapter.default_size()
    settings = Settings("a prompt", None, steps=2, guidance=7.5, seed=0, width=size, height=size)
    assert planned == {stage: int(stage_strategies(adapter, stage, settings, True, "fp32")[0].activation_bytes
                                  * DEVICE_ACTIVATION_MARGIN) for stage in ("encode", "denoise", "decode")}
    assert all(planned.values())


def test_the_users_own_cuda_graph_compile_over_streamed_weights_is_refused(sd):
    """Issue 34, item 10: a module the user compiled with torch.compile in a mode that captures CUDA graphs
    replays the addresses it captured, which streamed weights leave at every forward: optimize refuses it when
    its weights stream (and leaves the pipeline as it was), and lets it be where they stay resident or the mode
    captures none."""
    pipe, _ = sd
    blocks = pipe.unet.up_blocks
    try:
        with fake_cuda():
            pipe.unet.compile(mode="reduce-overhead")
            with pytest.raises(memfit.MemfitError, match=r"^unet is compiled with torch.compile in a mode that"):
                optimize(pipe, force_tiers={"unet/up_blocks.*": "host"}, device="cuda")
            assert not hasattr(pipe, "_memfit_plan")
            optimize(pipe, force_tiers={"vae/*": "host"}, device="cuda")  # the compiled unet stays resident
            restore(pipe)
            pipe.unet._compiled_call_impl = None
            blocks[1].compile(mode="max-autotune")
            with pytest.raises(memfit.MemfitError, match=r"^unet.up_blocks.1 is compiled"):
                optimize(pipe, force_tiers={"unet/up_blocks.*": "host"}, device="cuda")
            blocks[1].compile(mode="max-autotune-no-cudagraphs")
            optimize(pipe, force_tiers={"unet/up_blocks.*": "host"}, device="cuda")
            restore(pipe)
    finally:
        pipe.unet._compiled_call_impl = blocks[1]._compiled_call_impl = None


@contextlib.contextmanager
def copies_and_runs(pipe, monkeypatch):
    """A log of the unet's streamed units' copies started ahead on the side stream, ("copy", unit), and of every
    unit's forward as it starts, ("run", unit), in order; with the names of the streamed units."""
    state = pipe._memfit_state
    names = {id(module): name for name, module in pipe.unet.named_modules()}
    streamed = {id(HookRegistry.get(module).hooks[SwapHook.name]): names[id(module)] for module in state.hooked}
    log = []
    copy_on = SwapHook._copy_on

    def logged_copy(hook, *args):
        log.append(("copy", streamed[id(hook)]))
        return copy_on(hook, *args)

    monkeypatch.setattr(SwapHook, "_copy_on", logged_copy)
    units = [module for block in live_blocks("unet", pipe.unet) for module, _ in block.units]
    # registered after memfit's hooks, so each logs once memfit's own pre-forward work (copies started) is done
    handles = [module.register_forward_pre_hook(lambda module, args, name=names[id(module)]: log.append(("run", name)))
               for module in units]
    try:
        yield log, set(streamed.values())
    finally:
        for handle in handles:
            handle.remove()
        monkeypatch.undo()


@contextlib.contextmanager
def streamed_unet(tiny_models, force_tiers):
    """The tiny SD pipeline optimized with ``force_tiers`` on a lazy fake GPU, inside inference mode; yields it, the
    fake, its UNet's inputs and the UNet's output on them before optimize."""
    with fake_cuda(lazy=True) as gpu, torch.inference_mode():
        pipe = load(tiny_models("sd"))
        inputs = unet_inputs(pipe.unet)
        plain = pipe.unet(*inputs).sample
        optimize(pipe, force_tiers=force_tiers, device="cuda")
        try:
            yield pipe, gpu, inputs, plain
        finally:
            restore(pipe)


UNET_AROUND_ITS_MID_BLOCK = {"unet/down_blocks.*": "host", "unet/up_blocks.*": "host"}  # mid block, rest: resident


def test_a_resident_run_starts_the_copies_of_the_streamed_blocks_after_it(tiny_models, monkeypatch):
    """Issue 34, item 9: while resident blocks compute, the copy engine only copied the one streamed block the
    chain had started (each block starts the copy of the next as it starts). Now the first resident block of a
    run starts the copies of as many streamed blocks after it as the window holds (here the UNet's mid block
    runs resident between streamed down and up blocks): each has started before the resident run does, the
    memory stays within the window, and the output is all-resident's, bit for bit."""
    with streamed_unet(tiny_models, UNET_AROUND_ITS_MID_BLOCK) as (pipe, gpu, inputs, plain):
        window = pipe._memfit_state.runtime.window
        first = pipe.unet(*inputs).sample  # the order is learned
        bound = gpu.memory_allocated() + window * largest_streamed_block(pipe)
        gpu.reset_peak_memory_stats()
        with copies_and_runs(pipe, monkeypatch) as (log, streamed):
            again = pipe.unet(*inputs).sample
        peak = gpu.max_memory_reserved()
    mid_block = next(i for i, (kind, name) in enumerate(log) if kind == "run" and name.startswith("mid_block"))
    assert all(name.startswith("down_blocks") for kind, name in log[:mid_block] if kind == "run" and name in streamed)
    after = list(dict.fromkeys(name for kind, name in log[mid_block:] if kind == "run" and name in streamed))
    copied = {name for kind, name in log[:mid_block] if kind == "copy"}
    assert window == 2 and after[:window] and set(after[:window]) <= copied, (after[:window], copied)
    assert peak <= bound, (peak, bound)
    assert torch.equal(first, plain) and torch.equal(again, plain)


def test_the_first_forward_prefetches_in_the_plans_order(tiny_models, monkeypatch):
    """Issue 34, item 8: the first forward had no learned order, so every streamed block in it was copied in
    while the compute stream waited. Now the plan's order of the blocks stands in until they have run: the first
    forward copies blocks ahead too; where a block runs out of that order (the UNet's mid block is registered
    after its up blocks), what was read ahead for it is dropped, so the memory stays within the window; and
    the output is all-resident's, bit for bit."""
    with streamed_unet(tiny_models, {"unet/*": "host"}) as (pipe, gpu, inputs, plain):
        bound = gpu.memory_allocated() + pipe._memfit_state.runtime.window * largest_streamed_block(pipe)
        gpu.reset_peak_memory_stats()
        with copies_and_runs(pipe, monkeypatch) as (log, streamed):
            first = pipe.unet(*inputs).sample
        peak = gpu.max_memory_reserved()
    runs = [name for kind, name in log if kind == "run" and name in streamed]
    ahead = {name for kind, name in log if kind == "copy"}
    assert len(ahead) > len(runs) // 2, (len(ahead), len(runs))
    assert peak <= bound, (peak, bound)
    assert torch.equal(first, plain)


def test_streamed_blocks_come_in_with_no_host_wait_and_no_allocation(tiny_models, monkeypatch):
    """Issue 34, items 5 and 6: the host waited at every streamed block until the GPU had finished the block
    before (to keep the window), while the GPU idled; and each block came from the caching allocator, whose
    rounding and cached blocks the window did not count. Now the blocks run in the window's slots (BlockSlots),
    each copy ordered after the slot's last forward on the device: a forward of a UNet streamed whole makes the
    host wait nowhere and allocates nothing, the side stream never writes a slot a queued forward may still
    read, and the output is all-resident's, bit for bit. Without the slots (the allocator, as before) the same
    forward waits and allocates at its blocks; without the device-side waits the fake sees the overwrites."""
    from memfit.testing.fake_cuda import FakeStream

    def one_forward(pipe, gpu, inputs):
        waits, allocations = gpu.host_waits, gpu.allocations
        out = pipe.unet(*inputs).sample
        return out, gpu.host_waits - waits, gpu.allocations - allocations

    with streamed_unet(tiny_models, {"unet/*": "host"}) as (pipe, gpu, inputs, plain):
        first = pipe.unet(*inputs).sample  # learns the order; the slots are made
        again, waits, allocations = one_forward(pipe, gpu, inputs)
        assert (waits, allocations, gpu.unordered_overwrites) == (0, 0, 0)
        assert torch.equal(first, plain) and torch.equal(again, plain)

        wait_event = FakeStream.wait_event
        monkeypatch.setattr(FakeStream, "wait_stream", lambda self, other: None)
        monkeypatch.setattr(FakeStream, "wait_event", lambda self, event: wait_event(self, event) if self.compute else None)
        pipe.unet(*inputs)
        assert gpu.unordered_overwrites > 0
        monkeypatch.undo()

        monkeypatch.setattr(offload.BlockSlots, "take", lambda self, nbytes, modes: None)
        without_slots, _, allocations = one_forward(pipe, gpu, inputs)
        assert allocations >= len(pipe._memfit_state.hooked)  # a block from the allocator at every streamed unit
    assert torch.equal(without_slots, plain)
