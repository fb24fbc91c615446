"""memfit batch in local mode: jobs checked with line numbers, images equal memfit generate's, resumable."""

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import memfit
from memfit.batch import BatchOptions, JobDefaults, read_jobs, run_batch
from memfit.errors import MemfitError

SIZE = {"steps": 2, "width": 32, "height": 32}


def _write_jobs(path: Path, lines) -> Path:
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


def _results(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]


def _options(model, out, **extra) -> BatchOptions:
    return BatchOptions(model=model, out=out, budget="none", progress=False,
                        defaults=JobDefaults(steps=2, width=32, height=32), **extra)


def test_bad_lines_are_named_by_number_and_the_rest_parse(tmp_path):
    jobs = _write_jobs(tmp_path / "jobs.jsonl", [
        {"id": "a", "prompt": "a cat"},
        "{not json",
        {"id": "b"},
        "",
        {"id": "a", "prompt": "again"},
        {"id": "../up", "prompt": "x"},
        {"id": 7, "prompt": "x", "seed": -1},
        {"id": "c", "prompt": "x", "colour": "red"},
        [1, 2],
        {"id": 8, "prompt": "a dog", "guidance": 3, "negative_prompt": "blur"},
    ])
    good, bad = read_jobs(jobs, JobDefaults(seed=5, steps=4), model="/m", dtype="fp32")
    assert [job.id for job in good] == ["a", "8"]
    assert (good[0].seed, good[0].steps, good[0].guidance) == (5, 4, None)  # the flags fill what a job leaves out
    assert (good[1].guidance, good[1].negative_prompt, good[1].line) == (3.0, "blur", 10)
    by_line = {b.line: b.message for b in bad}
    assert sorted(by_line) == [2, 3, 5, 6, 7, 8, 9]
    assert "not valid JSON" in by_line[2] and "no prompt" in by_line[3] and "line 1" in by_line[5]
    assert "cannot name a file" in by_line[6] and '"seed"' in by_line[7] and "'colour'" in by_line[8]
    # The key is the content: another seed or model is another job, the same content the same key.
    again, _ = read_jobs(jobs, JobDefaults(seed=5, steps=4), model="/m", dtype="fp32")
    other, _ = read_jobs(jobs, JobDefaults(seed=6, steps=4), model="/m", dtype="fp32")
    assert again[0].key == good[0].key and other[0].key != good[0].key


def test_strict_refuses_up_front_and_writes_nothing(tiny_models, tmp_path):
    jobs = _write_jobs(tmp_path / "jobs.jsonl", [{"id": "a", "prompt": "a cat"}, {"id": "b", "prompt": "x", "width": 30}])
    out = tmp_path / "out"
    with pytest.raises(MemfitError, match=r"1 bad line.*line 2: job 'b': The width 30"):
        run_batch(jobs, _options(tiny_models("sd"), out, strict=True))
    assert not out.exists()


def test_local_batch_images_equal_memfit_generate_and_load_once(tiny_models, tmp_path, monkeypatch):
    model = tiny_models("sd")
    jobs = _write_jobs(tmp_path / "jobs.jsonl", [
        {"id": "red", "prompt": "a red circle", "seed": 1},
        {"id": "blue", "prompt": "a blue square", "negative_prompt": "blurry", "guidance": 5.0, "steps": 3},
        {"id": "bad", "prompt": "x", "width": 30},
        {"id": "red-again", "prompt": "a red circle", "seed": 2, "width": 48},
    ])
    from memfit.models.folder import ModelFolder

    loads = []
    real_load = ModelFolder.load_stage
    monkeypatch.setattr(ModelFolder, "load_stage",
                        lambda self, names, *a, **k: loads.append(tuple(names)) or real_load(self, names, *a, **k))
    out = tmp_path / "out"
    summary = run_batch(jobs, _options(model, out))
    assert (summary.done, summary.failed, summary.skipped, [b.line for b in summary.bad]) == (3, 0, 0, [3])
    assert len(loads) == 3, loads  # each stage loaded once for the whole batch
    lines = _results(out)
    assert [line["id"] for line in lines] == ["red", "blue", "red-again"]
    assert all(line["status"] == "ok" and line["peak_bytes"] > 0 and line["worker"].startswith("local@") for line in lines)
    assert [line["seed"] for line in lines] == [1, 0, 2]
    expected = {
        "red": dict(seed=1, steps=2, width=32, height=32),
        "blue": dict(seed=0, steps=3, width=32, height=32, negative_prompt="blurry", guidance=5.0),
        "red-again": dict(seed=2, steps=2, width=48, height=32),
    }
    prompts = {"red": "a red circle", "blue": "a blue square", "red-again": "a red circle"}
    for job_id, kwargs in expected.items():
        reference = memfit.generate(prompts[job_id], model=model, progress=False, **kwargs).save(tmp_path / f"{job_id}.png")
        # Same image and the same metadata, so the very same file.
        assert (out / f"{job_id}.png").read_bytes() == reference.read_bytes(), job_id
    assert sorted(p.name for p in out.iterdir()) == [".memfit-batch.lock", "blue.png", "red-again.png", "red.png",
                                                     "results.jsonl"]


def test_resume_skips_finished_jobs_by_id_and_content(tiny_models, tmp_path):
    model = tiny_models("sd")
    jobs = [{"id": "a", "prompt": "a red circle"}, {"id": "b", "prompt": "a blue square"}, {"id": "c", "prompt": "x"}]
    path = _write_jobs(tmp_path / "jobs.jsonl", jobs)
    out = tmp_path / "out"
    run_batch(path, _options(model, out))
    first = (out / "b.png").read_bytes()
    summary = run_batch(path, _options(model, out))
    assert (summary.done, summary.skipped) == (0, 3)
    assert len(_results(out)) == 3
    jobs[1]["seed"] = 9  # same id, other content: runs again; its new line replaces the old one
    (out / "c.png").unlink()  # a finished job whose image is gone runs again
    path = _write_jobs(path, jobs)
    summary = run_batch(path, _options(model, out))
    assert (summary.done, summary.skipped) == (2, 1)
    lines = _results(out)
    assert [line["id"] for line in lines] == ["a", "b", "c", "b", "c"]
    assert lines[3]["seed"] == 9 and (out / "b.png").read_bytes() != first


def test_an_unfinished_results_line_is_cut_off_and_its_job_runs_again(tiny_models, tmp_path):
    model = tiny_models("sd")
    path = _write_jobs(tmp_path / "jobs.jsonl", [{"id": "a", "prompt": "a red circle"}, {"id": "b", "prompt": "x"}])
    out = tmp_path / "out"
    run_batch(path, _options(model, out))
    data = (out / "results.jsonl").read_bytes()
    (out / "results.jsonl").write_bytes(data[:-20])  # the driver died in the middle of b's line
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (out / f".b.png.memfit-{int(dead.stdout)}-x1y2.tmp").write_bytes(b"\x89PNG half")  # and of another write
    (out / ".c.png.x1y2.tmp").write_bytes(b"another program's")  # not memfit's: never touched
    summary = run_batch(path, _options(model, out))
    assert (summary.done, summary.skipped) == (1, 1)
    assert [line["id"] for line in _results(out)] == ["a", "b"]
    assert [p.name for p in out.glob(".*.tmp")] == [".c.png.x1y2.tmp"]


def test_a_model_changed_in_place_runs_its_jobs_again(tiny_models, tmp_path):
    """A job's key names the model's content, not its folder: a model changed in place runs its jobs again
    instead of keeping their old images (issue 35, item 2), and the same model moved elsewhere runs nothing."""
    import shutil

    from safetensors.torch import load_file, save_file

    model = shutil.copytree(tiny_models("sd"), tmp_path / "model")
    path = _write_jobs(tmp_path / "jobs.jsonl", [{"id": "a", "prompt": "a red circle"}])
    out = tmp_path / "out"
    run_batch(path, _options(model, out))
    first = (out / "a.png").read_bytes()
    weights = next((model / "unet").glob("*.safetensors"))
    tensors = load_file(weights)
    bias = next(key for key in tensors if key.endswith("conv_out.bias"))
    tensors[bias] += 0.5
    save_file(tensors, weights, metadata={"format": "pt"})
    summary = run_batch(path, _options(model, out))
    assert (summary.done, summary.skipped) == (1, 0) and (out / "a.png").read_bytes() != first
    assert run_batch(path, _options(model.rename(tmp_path / "moved"), out)).skipped == 1


def test_a_job_failing_twice_is_recorded_and_the_batch_goes_on(tiny_models, tmp_path, monkeypatch):
    import memfit.run.session as generate_module  # where the workers' Session finds memfit.generate

    real = generate_module.generate
    tries = []

    def flaky(prompt, **kwargs):
        if prompt == "boom":
            tries.append(kwargs["pool"] is not None)
            raise MemfitError("the budget is too small for this job")
        return real(prompt, **kwargs)

    monkeypatch.setattr(generate_module, "generate", flaky)
    path = _write_jobs(tmp_path / "jobs.jsonl", [{"id": "a", "prompt": "boom"}, {"id": "b", "prompt": "a red circle"}])
    out = tmp_path / "out"
    summary = run_batch(path, _options(tiny_models("sd"), out))
    assert (summary.done, summary.failed) == (1, 1) and len(tries) == 2
    failed, ok = _results(out)
    assert failed["status"] == "failed" and failed["attempts"] == 2 and "budget is too small" in failed["error"]
    assert failed["file"] is None and not (out / "a.png").exists() and ok["status"] == "ok"
    # A failed job stays recorded on resume; --retry-failed runs it again.
    assert run_batch(path, _options(tiny_models("sd"), out)).skipped == 2
    monkeypatch.setattr(generate_module, "generate", real)
    summary = run_batch(path, _options(tiny_models("sd"), out, retry_failed=True))
    assert (summary.done, summary.skipped) == (1, 1) and _results(out)[-1]["status"] == "ok"


def test_one_driver_per_output_folder(tmp_path):
    from memfit.batch.output import BatchOutput

    with BatchOutput(tmp_path / "out"):
        with pytest.raises(MemfitError, match="Another memfit batch is writing"):
            with BatchOutput(tmp_path / "out"):
                pass


@pytest.mark.slow
def test_resume_after_killing_the_driver_mid_batch(tiny_models, tmp_path):
    """kill -9 the CLI mid-batch, resume: every job exactly once, every image whole and right."""
    model = tiny_models("sd")
    jobs = [{"id": f"j{i}", "prompt": ["a red circle", "a blue square", "a green triangle"][i % 3], "seed": i}
            for i in range(8)]
    path = _write_jobs(tmp_path / "jobs.jsonl", jobs)
    out = tmp_path / "out"
    command = [sys.executable, "-m", "memfit", "batch", str(path), "--model", model, "--out", str(out), "--budget",
               "none", "--steps", "2", "--width", "32", "--height", "32", "--quiet"]
    env = dict(os.environ, PYTHONPATH=str(Path(memfit.__file__).parents[1]))
    driver = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    results = out / "results.jsonl"
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and (not results.is_file() or results.read_text().count("\n") < 2):
        time.sleep(0.05)
    driver.send_signal(signal.SIGKILL)
    driver.wait()
    done_before = results.read_text().count("\n")
    assert 2 <= done_before < len(jobs), "the driver should have been killed mid-batch"
    from PIL import Image

    for png in out.glob("*.png"):  # whatever a kill left under a job's name is a whole image
        Image.open(png).verify()
    resumed = subprocess.run(command, env=env, capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr
    lines = _results(out)
    assert sorted(line["id"] for line in lines) == sorted(job["id"] for job in jobs)  # each exactly once
    assert not list(out.glob(".*.tmp"))
    reference = tmp_path / "reference"
    run_batch(path, _options(model, reference))
    for job in jobs:
        assert (out / f"{job['id']}.png").read_bytes() == (reference / f"{job['id']}.png").read_bytes(), job["id"]


def test_cli_refuses_workers_without_ray_and_names_the_extra_when_ray_is_missing(tiny_models, tmp_path, monkeypatch,
                                                                                  capsys):
    from memfit.cli.app import main

    jobs = _write_jobs(tmp_path / "jobs.jsonl", [{"id": "a", "prompt": "a red circle"}])
    assert main(["batch", str(jobs), "--out", str(tmp_path / "o"), "--workers", "2"]) == 2
    assert "--workers needs --ray" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "ray", None)  # as if memfit[ray] were not installed
    assert main(["batch", str(jobs), "--model", tiny_models("sd"), "--out", str(tmp_path / "o"), "--ray"]) == 2
    assert "pip install 'memfit[ray]'" in capsys.readouterr().err


@pytest.mark.skipif(importlib.util.find_spec("peft") is None, reason="LoRAs need peft (pip install memfit[lora])")
def test_a_jobs_loras_equal_memfit_generate_with_them(tiny_models, tmp_path):
    """A job's "loras" (or --lora, the jobs' default) run as memfit.generate's loras; a job without any keeps the
    key it had before jobs could name LoRAs; a LoRA file that is not there, or a family that takes none, is a bad
    line."""
    from memfit.testing.conditioning import save_lora

    model = tiny_models("flux")
    lora = save_lora(model, tmp_path / "lora", seed=1)
    jobs = _write_jobs(tmp_path / "jobs.jsonl", [
        {"id": "plain", "prompt": "a red circle", "seed": 3},
        {"id": "styled", "prompt": "a red circle", "seed": 3, "loras": [f"{lora}:0.7"]},
        {"id": "default", "prompt": "a red circle", "seed": 3},
        {"id": "missing", "prompt": "x", "loras": [str(tmp_path / "no-such.safetensors")]},
        {"id": "not-a-list", "prompt": "x", "loras": "style.safetensors"},
    ])
    out = tmp_path / "out"
    summary = run_batch(jobs, _options(model, out))
    good, _ = read_jobs(jobs, JobDefaults(steps=2, width=32, height=32), model="/m", dtype="fp32")
    assert good[0].key == "c3d89c0af207e7c53eb7669ea0b7a1e9"  # the key memfit gave this job before
    assert good[1].loras == ((str(lora.resolve()), 0.7),) and good[1].key != good[0].key
    assert [(b.line, b.message.split(": ", 1)[1]) for b in summary.bad] == [
        (4, f"LoRA file {tmp_path / 'no-such.safetensors'} does not exist"),
        (5, '"loras" must be a list of "PATH[:SCALE]" strings or [PATH, SCALE] pairs, not \'style.safetensors\'')]
    expected = memfit.generate("a red circle", model=model, progress=False, seed=3, loras=[(str(lora), 0.7)], **SIZE)
    assert (out / "styled.png").read_bytes() == expected.save(tmp_path / "styled.png").read_bytes()
    assert (out / "plain.png").read_bytes() != (out / "styled.png").read_bytes()
    # --lora: the jobs' default, which a job's own "loras" replaces
    defaults = JobDefaults(steps=2, width=32, height=32, loras=((str(lora), 0.7),))
    run_batch(jobs, BatchOptions(model=model, out=tmp_path / "with-default", budget="none", progress=False,
                                 defaults=defaults))
    assert (tmp_path / "with-default" / "default.png").read_bytes() == (out / "styled.png").read_bytes()
    # a family that takes no LoRA: a bad line naming those that do
    styled = _write_jobs(tmp_path / "styled.jsonl", [{"id": "styled", "prompt": "x", "loras": [str(lora)]}])
    summary = run_batch(styled, _options(tiny_models("pixart_sigma"), tmp_path / "pixart"))
    assert summary.done == 0 and "PixArtSigmaPipeline does not take --lora yet; supported: " in summary.bad[0].message
