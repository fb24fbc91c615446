"""memfit.compile.entry_points: the entry points pipelines call, compiled per component, removable, failures named.

Whatever the backend, outputs are plain tensors on every run (run 1, 2 and 3
agree with eager within the backend's stated tolerance) and torch's global settings are unchanged.
Failure 4: a compiled artifact is keyed by content, so two pipelines holding equal weights share
one cache entry.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import memfit
from memfit.compile.backends import Availability, Backend, get_backend, register_backend, snapshot_torch_settings, unregister_backend
from memfit.compile.entry_points import ENTRIES_ATTR, compile_components, is_compiled, parse_backend_arg, uncompile
from memfit.errors import MemfitError
from memfit.testing import assert_matches_diffusers, build_pipeline

SETTINGS = dict(steps=2, guidance=3.0, seed=3, width=32, height=32)


class _Broken(Backend):
    name = "test-broken"

    def compile(self, request):
        raise RuntimeError("this backend cannot compile anything")


class _Missing(Backend):
    name = "test-missing"

    def available(self):
        return Availability(False, "test-missing needs a library that is not installed")


@pytest.fixture
def broken_backends():
    register_backend("test-broken", _Broken, replace=True)
    register_backend("test-missing", _Missing, replace=True)
    yield
    unregister_backend("test-broken")
    unregister_backend("test-missing")


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MEMFIT_CACHE_DIR", str(tmp_path / "cache"))


def _latents(pipe, seed=0):
    return pipe(
        "a red house", num_inference_steps=2, guidance_scale=3.0, width=32, height=32,
        generator=torch.Generator().manual_seed(seed), output_type="latent",
    ).images


def _skip_unless(name):
    ok, reason = get_backend(name).available()
    if not ok:
        pytest.skip(reason)


def test_eager_backend_generation_is_bitwise_diffusers(tiny_models):
    ours, _ = assert_matches_diffusers(tiny_models("sd"), prompt="a red house", backend="eager", atol=0, **SETTINGS)
    by_stage = {s.stage: s.compiled for s in ours.report.stages}
    assert [(r["component"], r["entry"], r["status"]) for r in by_stage["denoise"]] == [("unet", "forward", "compiled")]
    assert ("vae", "decode", "compiled") in [(r["component"], r["entry"], r["status"]) for r in by_stage["decode"]]


def test_per_component_backends(tiny_models):
    result = memfit.generate("a red house", model=tiny_models("sd"), backend={"unet": "eager"}, progress=False, **SETTINGS)
    by_stage = {s.stage: s.compiled for s in result.report.stages}
    assert [r["component"] for r in by_stage["denoise"]] == ["unet"]
    assert by_stage["decode"] == []
    with pytest.raises(MemfitError, match="unet2"):
        compile_components(build_pipeline("sd"), {"unet2": "eager"})


def test_parse_backend_arg():
    assert parse_backend_arg("openvino") == "openvino"
    assert parse_backend_arg("unet=openvino,vae=eager") == {"unet": "openvino", "vae": "eager"}
    assert parse_backend_arg("inductor,vae=eager") == {"*": "inductor", "vae": "eager"}
    with pytest.raises(MemfitError):
        parse_backend_arg("unet=")


def test_backend_failure_names_component_and_backend(tiny_models, broken_backends):
    with pytest.raises(MemfitError, match=r"'test-broken'.*'unet'|'unet'.*'test-broken'"):
        memfit.generate("a red house", model=tiny_models("sd"), backend={"unet": "test-broken"}, progress=False, **SETTINGS)
    with pytest.raises(MemfitError, match="vae.*test-missing|test-missing.*vae"):
        compile_components(build_pipeline("sd"), {"vae": "test-missing"})


def test_fallback_is_reported_and_gives_eager_bits(tiny_models, broken_backends):
    ours, _ = assert_matches_diffusers(
        tiny_models("sd"), prompt="a red house", backend={"unet": "test-broken", "vae": "test-missing"},
        fallback="eager", atol=0, **SETTINGS,
    )
    records = [r for s in ours.report.stages for r in s.compiled]
    unet = next(r for r in records if r["component"] == "unet")
    assert unet["status"] == "fallback" and unet["backend_used"] == "eager"
    assert "this backend cannot compile anything" in unet["reason"]
    vae = next(r for r in records if r["component"] == "vae" and r["entry"] == "decode")
    assert vae["status"] == "fallback" and "not installed" in vae["reason"]
    notes = "\n".join(ours.report.notes)
    assert "unet.forward fell back from test-broken to eager" in notes
    assert "vae.decode fell back from test-missing to eager" in notes
    assert "fell back" in ours.report.table()


def test_records_say_in_json_notes_and_text_what_they_said_before_statuses_were_an_enum():
    """The strings memfit wrote for records before CompileStatus and weights_mapped existed, literally."""
    from memfit.compile.entry_points import CompileRecord, CompileStatus, report_records
    from memfit.run.report import RunReport, StageReport

    mapped = "torch weights (1.0 KiB) memory-mapped from /m/unet, not in memory"
    records = [
        CompileRecord("unet", "forward", "openvino", "openvino", CompileStatus.COMPILED, "", 1.5, 1, True, mapped,
                      weights_mapped=True),
        CompileRecord("vae", "decode", "openvino", "eager", CompileStatus.FALLBACK, "RuntimeError: no"),
        CompileRecord("vae", "encode", "openvino", "openvino"),
        CompileRecord("text_encoder", "forward", "eager", "eager", CompileStatus.SHARED),
        CompileRecord("unet/down.0", "forward", "openvino", "openvino", CompileStatus.COMPILED, "", 1.0, 1, True,
                      mapped, weights_mapped=True),
        CompileRecord("unet/up.0", "forward", "openvino", "openvino", CompileStatus.COMPILED, "", 2.0, 1, False,
                      mapped, weights_mapped=True),
    ]
    report = RunReport("cpu", "float32", "m", [StageReport("denoise", ["unet"], 1.0, 1, 0, 1, "rss")])
    report_records(report, records)
    assert json.dumps(report.to_dict()["stages"][0]["compiled"][:4]) == (
        '[{"component": "unet", "entry": "forward", "backend": "openvino", "backend_used": "openvino", '
        '"status": "compiled", "reason": "", "compile_seconds": 1.5, "signatures": 1, "cold": true, '
        '"weights": "torch weights (1.0 KiB) memory-mapped from /m/unet, not in memory"}, '
        '{"component": "vae", "entry": "decode", "backend": "openvino", "backend_used": "eager", '
        '"status": "fallback", "reason": "RuntimeError: no", "compile_seconds": 0.0, "signatures": 0, "cold": false, '
        '"weights": ""}, '
        '{"component": "vae", "entry": "encode", "backend": "openvino", "backend_used": "openvino", '
        '"status": "pending", "reason": "", "compile_seconds": 0.0, "signatures": 0, "cold": false, "weights": ""}, '
        '{"component": "text_encoder", "entry": "forward", "backend": "eager", "backend_used": "eager", '
        '"status": "shared", "reason": "", "compile_seconds": 0.0, "signatures": 0, "cold": false, "weights": ""}]'
    )
    assert all(type(record["status"]) is str for record in report.to_dict()["stages"][0]["compiled"])
    assert report.notes[0].startswith("denoise: unet.forward compiled with openvino in 1.50 s, built (no stored")
    assert report.notes[0].endswith("; torch weights (1.0 KiB) memory-mapped from /m/unet, not in memory")
    assert report.notes[1:] == [
        "denoise: vae.decode fell back from openvino to eager: RuntimeError: no",
        "denoise: 2 blocks of unet compiled with openvino in 3.00 s, 1 loaded from memfit's store, 1 built; "
        "their torch weights memory-mapped, not in memory",
    ]
    assert [str(record) for record in records[:4]] == [
        "unet.forward: openvino compiled in 1.50 s", "vae.decode: openvino failed, ran eager (RuntimeError: no)",
        "vae.encode: openvino pending", "text_encoder.forward: eager shared",
    ]
    assert f"{CompileStatus.SHARED}" == str(CompileStatus.SHARED) == "shared"


def test_uncompile_restores_exactly():
    pipe = build_pipeline("sd")
    override = lambda *a, **k: None  # noqa: E731  (someone else's instance override must survive)
    pipe.text_encoder.forward = override
    before = {name: dict(vars(m)) for name, m in pipe.components.items() if isinstance(m, torch.nn.Module)}
    records = compile_components(pipe, "eager", cache=False)
    assert {(r.component, r.entry) for r in records} == {
        ("unet", "forward"), ("vae", "decode"), ("vae", "encode"), ("text_encoder", "forward")
    }
    assert is_compiled(pipe) and "forward" in vars(pipe.unet) and "decode" in vars(pipe.vae)
    uncompile(pipe)
    assert not is_compiled(pipe)
    after = {name: dict(vars(m)) for name, m in pipe.components.items() if isinstance(m, torch.nn.Module)}
    assert after.keys() == before.keys()
    for name in before:
        assert after[name].keys() == before[name].keys(), name
        assert all(after[name][k] is before[name][k] for k in before[name]), name
    assert pipe.text_encoder.forward is override
    assert ENTRIES_ATTR not in vars(pipe.unet)


def test_optimize_with_backend_and_restore():
    pipe = build_pipeline("sd")
    pipe.set_progress_bar_config(disable=True)
    with torch.inference_mode():
        plain = _latents(pipe)
        assert memfit.optimize(pipe, backend="eager") is pipe
        assert is_compiled(pipe)
        assert torch.equal(_latents(pipe), plain)
        memfit.restore(pipe)
    assert not is_compiled(pipe) and "forward" not in vars(pipe.unet)


def test_a_new_generator_per_image_compiles_nothing_again():
    """A pipeline hands each image's generator to vae.decode: the compiled decoder must serve
    every image (keyed by the generator's identity, it compiled again per image and ran eagerly
    from the ninth on)."""
    pipe = build_pipeline("sd")
    pipe.set_progress_bar_config(disable=True)
    records = compile_components(pipe, "eager", cache=False)
    with torch.inference_mode():
        for seed in range(3):
            pipe("a red house", num_inference_steps=1, width=32, height=32, output_type="pt",
                 generator=torch.Generator().manual_seed(seed))
    decode = next(r for r in records if (r.component, r.entry) == ("vae", "decode"))
    assert (decode.status, decode.signatures) == ("compiled", 1)
    uncompile(pipe)


@pytest.mark.slow
def test_openvino_three_runs_plain_tensors_within_tolerance():
    _skip_unless("openvino")
    tolerance = get_backend("openvino").float32_tolerance
    pipe = build_pipeline("sd")
    pipe.set_progress_bar_config(disable=True)
    with torch.inference_mode():
        reference = _latents(pipe)
    settings_before = snapshot_torch_settings()
    records = compile_components(pipe, {"unet": "openvino"}, cache=False)
    runs = []
    with torch.inference_mode():
        for _ in range(3):
            latents = _latents(pipe)
            assert type(latents) is torch.Tensor
            latents.numpy()  # failure 5: no tensor subclass, no fake tensor
            runs.append(latents)
        direct = pipe.unet(torch.randn(1, 4, 4, 4), torch.tensor(3), torch.randn(1, 77, 32), return_dict=False)[0]
    assert type(direct) is torch.Tensor
    assert isinstance(direct.numpy(), np.ndarray)
    for latents in runs:
        assert (latents - reference).abs().max().item() <= tolerance
    assert torch.equal(runs[1], runs[0]) and torch.equal(runs[2], runs[0])  # every run like the first
    assert [r.status for r in records] == ["compiled"]
    assert snapshot_torch_settings() == settings_before
    uncompile(pipe)


@pytest.mark.slow
def test_onnxruntime_artifact_shared_by_content(tmp_path):
    """Two pipelines with equal VAE weights: one export, one cache entry, both load it. The second
    one runs no eager decode, not even one to learn the output structure (stored with the graph)."""
    _skip_unless("onnxruntime")
    from memfit.cache import CacheStore

    store = CacheStore(tmp_path / "store")
    latents = torch.randn(1, 4, 4, 4)
    tolerance = get_backend("onnxruntime").float32_tolerance
    outputs = []
    for _ in range(2):
        pipe = build_pipeline("sd", seed=0)
        with torch.inference_mode():
            reference = pipe.vae.decode(latents, return_dict=False)[0]
        eager_calls = []
        if outputs:  # the second pipeline: everything must come from the entry
            decoder_forward = pipe.vae.decoder.forward
            pipe.vae.decoder.forward = lambda *a, **k: eager_calls.append(1) or decoder_forward(*a, **k)
        records = compile_components(pipe, {"vae": "onnxruntime"}, cache=store)
        with torch.inference_mode():
            out = pipe.vae.decode(latents, return_dict=False)[0]
        assert eager_calls == []
        assert type(out) is torch.Tensor and (out - reference).abs().max().item() <= tolerance
        assert records[0].status == "compiled"
        outputs.append(out)
    assert torch.equal(outputs[0], outputs[1])
    assert len(store.ls("compiled")) == 1


_OPENVINO_START = """
import json, sys
import numpy as np
import torch
import memfit.compile.backends.openvino as openvino_backend
from memfit.compile.entry_points import compile_components
from memfit.testing import build_pipeline

if sys.argv[1] == "warm":  # served from the store, or this start fails
    def converted_again(*args, **kwargs):
        raise AssertionError("the openvino backend converted a model instead of loading the stored one")
    openvino_backend._convert = converted_again

def images(pipe):
    return pipe("a red house", num_inference_steps=2, guidance_scale=3.0, width=32, height=32,
                generator=torch.Generator().manual_seed(0), output_type="pt").images

pipe = build_pipeline("sd", seed=0)
with torch.inference_mode():
    eager = images(pipe)
records = compile_components(pipe, {"unet": "openvino", "vae": "openvino", "text_encoder": "openvino"})
with torch.inference_mode():
    runs = [images(pipe) for _ in range(3)]
    decoded = pipe.vae.decode(torch.randn(1, 4, 4, 4)).sample  # a dataclass output, rebuilt from the store
np.save(sys.argv[2], np.stack([eager.numpy()] + [run.numpy() for run in runs]))  # .numpy(): failure 5
print(json.dumps({
    "types": sorted({type(t).__name__ for t in [*runs, decoded]}),
    "records": sorted([r.component, r.entry, r.status] for r in records),
}))
"""


def _openvino_start(phase, out, env):
    run = subprocess.run(
        [sys.executable, "-c", _OPENVINO_START, phase, str(out)], capture_output=True, text=True, timeout=600, env=env
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1]), np.load(out)


@pytest.mark.slow
def test_openvino_compiled_once_then_loaded_in_a_fresh_process(tmp_path):
    """A second start loads every OpenVINO model from memfit's store (MEMFIT_CACHE=require: a miss
    is an error, and converting is refused), with plain tensors equal to the first start's."""
    _skip_unless("openvino")
    from memfit.cache import CacheStore

    env = {**os.environ, "HF_HUB_OFFLINE": "1"}  # MEMFIT_CACHE_DIR: this test's private store
    cold_info, cold = _openvino_start("cold", tmp_path / "cold.npy", env)
    warm_info, warm = _openvino_start("warm", tmp_path / "warm.npy", {**env, "MEMFIT_CACHE": "require"})

    expected_records = [
        ["text_encoder", "forward", "compiled"], ["unet", "forward", "compiled"],
        ["vae", "decode", "compiled"], ["vae", "encode", "pending"],
    ]
    for info in (cold_info, warm_info):
        assert info == {"types": ["Tensor"], "records": expected_records}
    tolerance = get_backend("openvino").float32_tolerance
    for arrays in (cold, warm):
        eager, runs = arrays[0], arrays[1:]
        assert all(np.abs(run - eager).max() <= tolerance for run in runs)
        assert all(np.array_equal(run, runs[0]) for run in runs)  # run 1, 2 and 3 alike
    assert np.array_equal(warm[1:], cold[1:])  # a cached start gives what the first start gave
    store = CacheStore(os.environ["MEMFIT_CACHE_DIR"])
    entries = store.ls("compiled")
    assert len(entries) == 4 and {e.parts["backend"] for e in entries} == {"openvino"}  # + decode 1x4x4x4
    assert store.verify() == []
