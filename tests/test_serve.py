"""memfit serve: the A1111-compatible API over a warm Session, on a tiny pipeline (no network).

Every image must equal, byte for byte (PNG metadata included), what `memfit generate` writes for
the same inputs; refusals are 422s (a body too large a 413) that say what to do, before anything is
queued or decoded; the queue is FIFO and a cancelled or interrupted job frees it, and a stopping
server stops it after its grace period.
"""

import base64
import io
import json
import logging
import re
import struct
import subprocess
import sys
import threading
import time
import zlib

import pytest
from fastapi.testclient import TestClient
from PIL import Image

from memfit.cli.app import main
from memfit.errors import MemfitError
from memfit.run.session import Session
from memfit.serve import Limits, create_app
from memfit.serve.jobs import Job, JobQueue

BASE = {"prompt": "a red circle", "negative_prompt": "blurry", "steps": 2, "cfg_scale": 3.5, "width": 32, "height": 32}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(client, session, model folder) for a tiny SD pipeline, one server for the module."""
    from memfit.testing import save_pipeline

    model = str(save_pipeline("sd", tmp_path_factory.mktemp("serve") / "sd", seed=0))
    session = Session(model)
    limits = Limits(max_steps=40, max_pixels=64 * 64, max_images=4, max_body_bytes=64 * 1024, max_prompt_chars=100)
    with TestClient(create_app(session, limits=limits)) as client:
        yield client, session, model


def generated_png(model, tmp_path, *args):
    out = tmp_path / "cli.png"
    assert main(["generate", "--model", model, "--quiet", "--out", str(out), *args]) == 0
    return out.read_bytes()


def cli_args(seed, **fields):
    body = {**BASE, **fields}
    return ["--prompt", body["prompt"], "--negative-prompt", body["negative_prompt"], "--steps", str(body["steps"]),
            "--guidance", str(body["cfg_scale"]), "--width", str(body["width"]), "--height", str(body["height"]),
            "--seed", str(seed)]


def test_txt2img_bytes_equal_memfit_generate_and_stay_equal_when_warm(served, tmp_path):
    client, session, model = served
    first = client.post("/sdapi/v1/txt2img", json={**BASE, "seed": 7})
    assert first.status_code == 200, first.text
    # batch_size 2: seeds 8 and 9 (A1111's seed + index), both served by the stages kept warm
    second = client.post("/sdapi/v1/txt2img", json={**BASE, "seed": 8, "batch_size": 2})
    assert second.status_code == 200, second.text
    body = second.json()
    info = json.loads(body["info"])
    assert info["all_seeds"] == [8, 9] and info["seed"] == 8 and len(body["images"]) == 2
    assert body["parameters"]["seed"] == 8 and body["parameters"]["cfg_scale"] == 3.5
    assert base64.b64decode(first.json()["images"][0]) == generated_png(model, tmp_path, *cli_args(7))
    assert base64.b64decode(body["images"][1]) == generated_png(model, tmp_path, *cli_args(9))
    assert Image.open(io.BytesIO(base64.b64decode(body["images"][1]))).text["seed"] == "9"
    report = client.get(info["memfit"]["report"]).json()
    assert report["state"] == "done" and len(report["runs"]) == 2
    notes = [{stage["stage"]: stage["note"] for stage in run["stages"]} for run in report["runs"]]
    # the repeated prompt comes from the prompt cache; the denoiser and the VAE were kept loaded
    assert notes == [{"encode": "cache hit", "denoise": "warm", "decode": "warm"}] * 2, notes
    assert set(report["warm"]["components"]) >= {"encode:text_encoder", "denoise:unet", "decode:vae"}


def test_a_mapped_sampler_equals_memfit_generate_with_it(served, tmp_path):
    client, _, model = served
    response = client.post("/sdapi/v1/txt2img", json={**BASE, "seed": 3, "sampler_name": "Euler a"})
    assert response.status_code == 200, response.text
    png = base64.b64decode(response.json()["images"][0])
    assert png == generated_png(model, tmp_path, *cli_args(3), "--sampler", "Euler a")
    assert Image.open(io.BytesIO(png)).text["sampler"] == "Euler a"
    assert png != generated_png(model, tmp_path, *cli_args(3)), "the sampler changed nothing"
    karras = client.post("/sdapi/v1/txt2img", json={**BASE, "seed": 3, "sampler_name": "DPM++ 2M", "scheduler": "karras"})
    assert json.loads(karras.json()["info"])["sampler_name"] == "DPM++ 2M Karras"


def test_seed_minus_one_is_random_and_reported(served):
    client, _, _ = served
    seeds = []
    for _ in range(2):
        response = client.post("/sdapi/v1/txt2img", json={**BASE, "seed": -1, "steps": 1})
        info = json.loads(response.json()["info"])
        png = Image.open(io.BytesIO(base64.b64decode(response.json()["images"][0])))
        assert 0 <= info["seed"] < 2**32 and png.text["seed"] == str(info["seed"])
        seeds.append(info["seed"])
    assert seeds[0] != seeds[1]


@pytest.mark.parametrize("body, says", [
    ({"sampler_name": "DPM fast"}, "no diffusers equivalent"),
    ({"sampler_name": "Euler", "scheduler": "Polyexponential"}, "not a schedule type memfit can follow; use one of: "
                                                               "automatic, karras, exponential"),
    ({"sampler_name": "Euler a", "scheduler": "karras"}, "cannot follow the Karras schedule type on this model; "
                                                        "use one of: Automatic, SGM Uniform, Simple"),
    ({"sampler_name": "k_euler_a", "scheduler": "beta"}, "'Euler a' cannot follow the Beta schedule type"),
    ({"width": 36}, "multiple of 8"),
    ({"steps": 41}, "at most 40"),
    ({"width": 128, "height": 64}, "pixels"),
    ({"batch_size": 3, "n_iter": 2}, "1 to 4 images"),
    ({"seed": -2}, "seed must be -1"),
    ({"prompt": ""}, 'The prompt is empty: send a description of the image in the JSON field "prompt"'),
    ({"prompt": "a" * 101}, "prompt has 101 characters, more than the 100 a request may send"),
    ({"negative_prompt": "a" * 101}, "negative_prompt has 101 characters, more than the 100"),
    ({"prompt": "a cat <lora:style:0.8>"}, "No LoRA 'style' is listed: this server lists none; start memfit serve "
                                           "with --models-dir DIR"),
])
def test_requests_that_cannot_run_get_422_saying_why(served, body, says):
    client, _, _ = served
    response = client.post("/sdapi/v1/txt2img", json={**BASE, **body})
    assert response.status_code == 422, response.text
    assert says in response.json()["detail"]


def test_malformed_bodies_get_422_not_500(served):
    client, _, _ = served
    bad_json = client.post("/sdapi/v1/txt2img", content=b'{"prompt": "a", ', headers={"content-type": "application/json"})
    assert bad_json.status_code == 422
    wrong_type = client.post("/sdapi/v1/txt2img", json={**BASE, "steps": "many"})
    assert wrong_type.status_code == 422
    assert client.post("/sdapi/v1/options", content=b"[1", headers={"content-type": "application/json"}).status_code == 422
    assert client.post("/sdapi/v1/img2img", json={"init_images": []}).status_code == 422


def test_unsupported_fields_are_reported_not_silently_dropped(served):
    client, _, _ = served
    response = client.post("/sdapi/v1/txt2img", json={**BASE, "steps": 1, "restore_faces": False, "enable_hr": True,
                                                      "styles": []})
    assert json.loads(response.json()["info"])["memfit"]["ignored_fields"] == ["enable_hr"]


def test_models_options_samplers_and_progress_when_idle(served):
    client, session, model = served
    models = client.get("/sdapi/v1/sd-models").json()
    assert models[0]["filename"] == model and models[0]["title"] == "sd"
    options = client.get("/sdapi/v1/options").json()
    assert options["sd_model_checkpoint"] == "sd" and options["memfit_pipeline"] == "StableDiffusionPipeline"
    assert client.post("/sdapi/v1/options", json={"sd_model_checkpoint": "sd"}).status_code == 200
    assert client.post("/sdapi/v1/options", json={"sd_model_checkpoint": "other"}).status_code == 422
    names = [s["name"] for s in client.get("/sdapi/v1/samplers").json()]
    assert {"Euler", "Euler a", "DPM++ 2M", "DDIM", "PLMS"} <= set(names)
    progress = client.get("/sdapi/v1/progress").json()
    assert progress["progress"] == 0 and progress["state"]["job_count"] == 0 and progress["memfit"]["queue_length"] == 0
    page = client.get("/")
    assert page.status_code == 200 and 'id="prompt"' in page.text and "/sdapi/v1/txt2img" in page.text


def test_memory_in_a1111s_shape_on_a_gpu_and_without_one(served):
    from memfit.testing.fake_cuda import DEFAULT_TOTAL, fake_cuda

    _, _, model = served
    with TestClient(create_app(Session(model, device="cpu"))) as cpu:
        on_cpu = cpu.get("/sdapi/v1/memory").json()
    assert on_cpu["cuda"] == {"error": "unavailable: this server runs on cpu"}
    assert on_cpu["ram"]["total"] >= on_cpu["ram"]["used"] > 0
    with fake_cuda(), TestClient(create_app(Session(model, device="cuda"))) as gpu:
        cuda = gpu.get("/sdapi/v1/memory").json()["cuda"]
    assert cuda["system"] == {"free": DEFAULT_TOTAL, "used": 0, "total": DEFAULT_TOTAL}
    assert set(cuda) == {"system", "allocated", "reserved", "events"}


def test_extras_past_the_pixel_limit_or_with_face_restoration_get_422(served):
    client, _, _ = served
    image = b64_png(Image.new("RGB", (32, 32)))
    too_big = client.post("/sdapi/v1/extra-single-image", json={"image": image, "upscaler_1": "Lanczos",
                                                                "upscaling_resize": 4})
    assert too_big.status_code == 422 and "16384 pixels, more than the 4096" in too_big.json()["detail"]
    faces = client.post("/sdapi/v1/extra-single-image", json={"image": image, "gfpgan_visibility": 1})
    assert faces.status_code == 422 and "no face restorers" in faces.json()["detail"]


def test_progress_then_interrupt_stops_the_running_request(served):
    client, _, _ = served
    result = {}
    worker = threading.Thread(target=lambda: result.update(
        response=client.post("/sdapi/v1/txt2img", json={**BASE, "steps": 40, "force_task_id": "long"})))
    worker.start()
    deadline = time.time() + 60
    progress = None
    while time.time() < deadline:
        progress = client.get("/sdapi/v1/progress", params={"id_task": "long"}).json()
        if progress["state"]["sampling_step"] >= 1:
            break
        time.sleep(0.02)
    assert progress["memfit"]["queue_position"] == 0 and progress["state"]["sampling_steps"] == 40
    assert 0 < progress["progress"] < 1 and progress["state"]["job"] == "long"
    assert client.post("/sdapi/v1/interrupt").status_code == 200
    worker.join(60)
    info = json.loads(result["response"].json()["info"])
    assert info["memfit"]["interrupted"] and result["response"].json()["images"] == []
    # the queue is free again and the warm stages still give the right image
    after = client.post("/sdapi/v1/txt2img", json={**BASE, "seed": 1, "steps": 1})
    assert after.status_code == 200 and len(after.json()["images"]) == 1


class FakeSession:
    """Session stand-in for the queue: records the order of runs; a run blocks until released."""

    def __init__(self):
        self.ran, self.gates = [], {}

    def generate(self, prompt, on_step=None, **settings):
        gate = self.gates.setdefault(prompt, threading.Event())
        for step in range(1, 3):
            on_step("denoise", step, 2)
            if not gate.wait(10):
                raise AssertionError("never released")
        self.ran.append(prompt)
        image = Image.new("RGB", (2, 2))

        class Generation:
            images, metadata = [image], {}
            report = type("R", (), {"to_dict": lambda self: {"stages": []}})()

        return Generation()


def test_the_queue_is_fifo_and_a_cancelled_job_frees_its_slot():
    session = FakeSession()
    queue = JobQueue(session)
    jobs = [queue.submit(Job([{"prompt": name}])) for name in ("a", "b", "c", "d")]
    deadline = time.time() + 5
    while jobs[0].state != "running" and time.time() < deadline:
        time.sleep(0.01)
    assert [queue.position(job) for job in jobs] == [0, 1, 2, 3]
    queue.cancel(jobs[2])  # a waiting client that went away
    assert jobs[2].state == "cancelled" and queue.position(jobs[3]) == 2
    for name in ("a", "b", "d"):
        session.gates.setdefault(name, threading.Event()).set()
    assert all(job.done.wait(10) for job in jobs)
    assert session.ran == ["a", "b", "d"] and [j.state for j in jobs] == ["done", "done", "cancelled", "done"]
    queue.stop(10)


def test_stopping_cancels_waiting_jobs_and_lets_the_running_one_finish():
    session = FakeSession()
    queue = JobQueue(session)
    running, waiting = queue.submit(Job([{"prompt": "a"}])), queue.submit(Job([{"prompt": "b"}]))
    while running.state != "running":
        time.sleep(0.01)
    queue.close()
    assert waiting.state == "cancelled" and "stopped" in waiting.error
    with pytest.raises(MemfitError, match="shutting down"):
        queue.submit(Job([{"prompt": "c"}]))
    session.gates["a"].set()
    queue.stop(10)
    assert running.state == "done" and session.ran == ["a"]


def test_a_cancelled_running_job_stops_at_its_next_step():
    session = FakeSession()
    queue = JobQueue(session)
    job = queue.submit(Job([{"prompt": "a"}, {"prompt": "a2"}]))
    while job.step < 1:
        time.sleep(0.01)
    queue.cancel(job)  # a client that went away mid-run
    session.gates["a"].set()
    assert job.done.wait(10) and job.state == "interrupted" and session.ran == []
    queue.stop(10)


class StuckSession:
    """Session stand-in whose run spends a while in one call that checks nothing (a tokenizer given a huge prompt)
    between the encode stage's start and the denoise stage's."""

    def generate(self, prompt, on_step=None, **settings):
        on_step("encode", 0, 0)
        time.sleep(0.5)
        on_step("denoise", 0, 0)
        raise AssertionError("the run went on past the denoise stage's start")


def test_a_stopping_server_stops_a_job_stuck_in_encoding_once_its_grace_is_over():
    queue = JobQueue(StuckSession())
    job = queue.submit(Job([{"prompt": "a"}]))
    while job.state != "running":
        time.sleep(0.01)
    assert queue.stop(10, grace=0.1), "the worker did not end"
    assert job.state == "interrupted"


def test_basic_auth_when_asked_and_no_open_bind_without_it(served):
    from memfit.cli.serve import check_bind

    _, session, _ = served
    app = create_app(session, auth="user:secret")
    with TestClient(app) as client:
        assert client.get("/sdapi/v1/options").status_code == 401
        assert client.get("/sdapi/v1/options", auth=("user", "wrong")).status_code == 401
        assert client.get("/sdapi/v1/options", auth=("user", "secret")).status_code == 200
        token = base64.b64encode(b"user:secret").decode()
        for scheme in ("basic", "BASIC"):  # a scheme's name is case-insensitive in HTTP
            assert client.get("/sdapi/v1/options", headers={"authorization": f"{scheme} {token}"}).status_code == 200
        assert client.get("/sdapi/v1/options", headers={"authorization": f"Bearer {token}"}).status_code == 401
    with pytest.raises(MemfitError, match="--api-auth"):
        check_bind("0.0.0.0", None)
    with pytest.raises(MemfitError, match="USER:PASSWORD"):
        check_bind("0.0.0.0", "nopassword")
    check_bind("0.0.0.0", "user:secret")
    check_bind("127.0.0.1", None)
    check_bind("::1", None)


def test_import_memfit_does_not_import_the_server():
    code = "import sys, memfit, memfit.run.session; print(','.join(m for m in ('fastapi', 'uvicorn', 'starlette') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "", f"`import memfit` imported {out}"


def test_a_request_the_budget_cannot_fit_gets_422_with_what_works(served):
    from memfit.run.memory import current_rss

    _, session, model = served
    tight = Session(model, budget=current_rss() + 8 * 2**20)  # below the denoiser's activations
    with TestClient(create_app(tight)) as client:
        response = client.post("/sdapi/v1/txt2img", json={**BASE, "seed": 1})
        assert response.status_code == 422, response.text
        assert "smallest budget that works" in response.json()["detail"]
        assert client.get("/sdapi/v1/progress").json()["state"]["job_count"] == 0  # the queue is free


# ---- img2img and inpainting ---------------------------------------------------------------------

def b64_png(image, prefix=""):
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return prefix + base64.b64encode(buffer.getvalue()).decode()


def test_img2img_bytes_equal_memfit_generate_with_image_and_strength(served, tmp_path):
    from memfit.testing.conditioning import test_image

    client, _, model = served
    init = tmp_path / "init.png"
    test_image(32, seed=1).save(init)
    response = client.post("/sdapi/v1/img2img", json={**BASE, "seed": 5, "init_images": [b64_png(Image.open(init))],
                                                      "denoising_strength": 0.6})
    assert response.status_code == 200, response.text
    body = response.json()
    png = base64.b64decode(body["images"][0])
    assert png == generated_png(model, tmp_path, *cli_args(5), "--image", str(init), "--strength", "0.6")
    assert Image.open(io.BytesIO(png)).text["strength"] == "0.6"
    info = json.loads(body["info"])
    assert info["denoising_strength"] == 0.6 and "Denoising strength: 0.6" in info["infotexts"][0]
    assert body["parameters"]["denoising_strength"] == 0.6 and body["parameters"]["init_images"] is None
    # A1111's default strength (0.75) when the field is left out; width and height may be left out too
    default = client.post("/sdapi/v1/img2img", json={"prompt": BASE["prompt"], "steps": 2, "seed": 5,
                                                     "init_images": [b64_png(Image.open(init))]})
    assert default.status_code == 200, default.text
    assert Image.open(io.BytesIO(base64.b64decode(default.json()["images"][0]))).text["strength"] == "0.75"


def test_inpaint_with_a_mask_equals_memfit_generate_with_it(served, tmp_path):
    import memfit
    from memfit.run.media import png_bytes
    from memfit.testing.conditioning import test_image, test_mask

    client, _, model = served
    image, mask = test_image(32, seed=2), test_mask(32)
    response = client.post("/sdapi/v1/img2img", json={
        **BASE, "seed": 11, "denoising_strength": 0.9, "init_images": [b64_png(image, "data:image/png;base64,")],
        "mask": b64_png(mask, "data:image/png;base64,"),
        # A1111's img2img defaults: those that would change A1111's image are reported, not dropped
        "mask_blur": 4, "inpainting_fill": 1, "inpaint_full_res": True, "resize_mode": 0,
        "include_init_images": False, "image_cfg_scale": None, "styles": []})
    assert response.status_code == 200, response.text
    expected = memfit.generate(BASE["prompt"], model=model, negative_prompt=BASE["negative_prompt"], steps=2,
                               guidance=3.5, width=32, height=32, seed=11, image=image, strength=0.9, mask=mask,
                               progress=False)
    png = base64.b64decode(response.json()["images"][0])
    assert png == png_bytes(expected.images[0], expected.metadata)
    assert Image.open(io.BytesIO(png)).text["task"] == "inpaint"
    ignored = json.loads(response.json()["info"])["memfit"]["ignored_fields"]
    assert ignored == ["inpaint_full_res", "inpainting_fill", "mask_blur"]
    # without a mask the mask's fields change nothing, in A1111 too; a non-default resize_mode is reported
    plain = client.post("/sdapi/v1/img2img", json={**BASE, "init_images": [b64_png(image)],
                                                   "mask_blur": 4, "inpaint_full_res": True, "resize_mode": 1,
                                                   "include_init_images": True})
    assert plain.status_code == 200, plain.text
    assert json.loads(plain.json()["info"])["memfit"]["ignored_fields"] == ["include_init_images", "resize_mode"]


def test_img2img_on_a_family_without_it_gets_422_with_memfits_own_message(tiny_models):
    import memfit
    from memfit.testing.conditioning import test_image

    model = tiny_models("flux")
    image = test_image(32)
    with pytest.raises(MemfitError) as refused:
        memfit.generate("a red circle", model=model, steps=2, image=image, strength=0.75, progress=False)
    with TestClient(create_app(Session(model))) as client:
        response = client.post("/sdapi/v1/img2img", json={"prompt": "a red circle", "steps": 2,
                                                          "init_images": [b64_png(image)]})
        assert response.status_code == 422, response.text
        assert response.json()["detail"] == str(refused.value) and "--image" in str(refused.value)
        assert client.get("/sdapi/v1/progress").json()["state"]["job_count"] == 0


@pytest.mark.parametrize("fields, says", [
    ({"init_images": ["not base64 at all!"]}, "init_images[0] is not valid base64"),
    ({"init_images": [base64.b64encode(b"plain text, not a picture").decode()]}, "init_images[0] is not an image"),
    ({"mask": "@@@"}, "mask is not valid base64"),
    ({"init_images": []}, "init_images needs one base64 image"),
    ({"init_images": None}, "init_images needs one base64 image"),
    ({"width": 48}, "draws at the size of --image"),
    ({"denoising_strength": 0}, "--strength must be in (0, 1]"),
])
def test_img2img_requests_that_cannot_run_get_422_saying_why(served, fields, says):
    from memfit.testing.conditioning import test_image

    client, _, _ = served
    response = client.post("/sdapi/v1/img2img", json={**BASE, "init_images": [b64_png(test_image(32))], **fields})
    assert response.status_code == 422, response.text
    assert says in response.json()["detail"]


def test_a_body_over_the_limit_gets_413_naming_the_limit(served):
    client, _, _ = served
    body = json.dumps({**BASE, "negative_prompt": "a" * 70_000}).encode()
    json_type = {"content-type": "application/json"}
    declared = client.post("/sdapi/v1/txt2img", content=body, headers=json_type)
    assert declared.status_code == 413, declared.text
    assert "more than the 64.00 KiB a request may send" in declared.json()["detail"]
    chunked = client.post("/sdapi/v1/txt2img", content=iter([body[:40_000], body[40_000:]]), headers=json_type)
    assert chunked.status_code == 413, chunked.text
    assert "(memfit serve --max-body raises the limit)" in chunked.json()["detail"]
    assert client.get("/sdapi/v1/progress").json()["state"]["job_count"] == 0


def blank_png(width, height):
    """A valid PNG of ``width`` x ``height`` black pixels (1 bit each), a few KB however many pixels its header gives."""
    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    rows = zlib.compress(b"\0" * ((1 + (width + 7) // 8) * height), 9)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0))
            + chunk(b"IDAT", rows) + chunk(b"IEND", b""))


def test_an_image_past_the_pixel_limit_is_refused_from_its_header(served):
    from memfit.testing.conditioning import test_image

    client, session, _ = served
    huge = base64.b64encode(blank_png(12000, 12000)).decode()  # 144 megapixels in 18 KB
    small = b64_png(test_image(32))
    for route, fields, name in (("img2img", {**BASE, "init_images": [huge]}, "init_images[0]"),
                                ("img2img", {**BASE, "init_images": [small], "mask": huge}, "mask"),
                                ("png-info", {"image": huge}, "image"),
                                ("extra-single-image", {"image": huge, "upscaler_1": "None"}, "image")):
        response = client.post(f"/sdapi/v1/{route}", json=fields)
        assert response.status_code == 422, response.text
        assert response.json()["detail"].startswith(f"{name} is 12000x12000, 144000000 pixels, more than the 4096 a "
                                                    "request may send"), response.text
    # past Pillow's decompression-bomb limit even where --max-pixels would let it through
    with TestClient(create_app(session, limits=Limits(max_pixels=10**9))) as lenient:
        response = lenient.post("/sdapi/v1/png-info", json={"image": huge})
    assert response.status_code == 422 and "decompression-bomb limit" in response.json()["detail"]


def test_an_image_is_decoded_off_the_event_loop(served, monkeypatch):
    from memfit.testing.conditioning import test_image

    client, _, _ = served
    body = {**BASE, "steps": 1, "init_images": [b64_png(test_image(32))]}
    decoding, release = threading.Event(), threading.Event()
    convert = Image.Image.convert

    def slow_convert(image, *args, **kwargs):
        decoding.set()
        release.wait(30)
        return convert(image, *args, **kwargs)

    monkeypatch.setattr(Image.Image, "convert", slow_convert)
    posted = threading.Thread(target=client.post, args=("/sdapi/v1/img2img",), kwargs={"json": body})
    posted.start()
    assert decoding.wait(30)
    poll = threading.Thread(target=client.get, args=("/sdapi/v1/progress",))
    poll.start()
    poll.join(10)
    held_up = poll.is_alive()
    release.set()
    posted.join(60)
    poll.join(60)
    assert not held_up, "while an image was decoded no other client got an answer"


def test_an_init_image_of_a_size_the_model_cannot_take_is_resized_and_the_info_says_so(served):
    import memfit
    from memfit.run.media import png_bytes
    from memfit.testing.conditioning import test_image

    client, _, model = served
    image = test_image(32, seed=3).resize((33, 35))
    response = client.post("/sdapi/v1/img2img", json={**BASE, "seed": 4, "init_images": [b64_png(image)]})
    assert response.status_code == 200, response.text
    info = json.loads(response.json()["info"])
    assert (info["width"], info["height"]) == (32, 32)
    assert info["memfit"]["notes"] == ["init_images[0] is 33x35; memfit resized it to 32x32, the nearest multiples "
                                       "of 8 below, as StableDiffusionPipeline needs."]
    expected = memfit.generate(BASE["prompt"], model=model, negative_prompt=BASE["negative_prompt"], steps=2,
                               guidance=3.5, seed=4, image=image.resize((32, 32), Image.Resampling.LANCZOS),
                               strength=0.75, progress=False)
    assert base64.b64decode(response.json()["images"][0]) == png_bytes(expected.images[0], expected.metadata)


def test_a_request_estimated_past_max_seconds_is_refused_with_the_largest_size_that_fits(served):
    from memfit.serve.costs import Measured

    _, session, _ = served
    app = create_app(session, limits=Limits(max_seconds=1))
    with TestClient(app) as client:
        assert json.loads(client.post("/sdapi/v1/txt2img", json={**BASE, "width": 16, "height": 16}).json()["info"])[
            "memfit"]["estimated_seconds"] is None  # nothing measured yet; 16x16 is too small to estimate 64x64 from
        app.state.step_times.record(session.folder.path, Measured(32, 32, 0.05))  # as an earlier run would
        # 4x the pixels of the measured size, 40 steps, 4 images: 4 * 40 * 4 * 0.05 s
        refused = client.post("/sdapi/v1/txt2img", json={**BASE, "width": 64, "height": 64, "steps": 40,
                                                         "batch_size": 4})
        assert refused.status_code == 422, refused.text
        assert refused.json()["detail"] == (
            "64x64 at 40 steps x 4 images would hold the server for about 32 s of denoising (estimated from 0.05 s "
            "per step at 32x32 on this checkpoint, in proportion to pixels x steps), more than the 1 s a request may "
            "take; ask for at most 8x8 (the largest size of about this shape that fits) or at most 1 steps at 64x64 "
            "or fewer images (memfit serve --max-seconds raises the limit).")
        assert client.get("/sdapi/v1/progress").json()["state"]["job_count"] == 0
        fits = client.post("/sdapi/v1/txt2img", json=BASE)
        assert json.loads(fits.json()["info"])["memfit"]["estimated_seconds"] == 0.1
    # Nothing measured near the size asked for: the job's own pace stops it after its second step.
    with TestClient(create_app(session, limits=Limits(max_seconds=0.1))) as client:
        stopped = client.post("/sdapi/v1/txt2img", json={**BASE, "steps": 40, "batch_size": 4, "force_task_id": "slow"})
        assert stopped.status_code == 422, stopped.text
        assert stopped.json()["detail"].startswith("32x32 at 40 steps x 4 images would hold the server for about ")
        report = client.get("/memfit/v1/report/slow").json()
        assert report["state"] == "failed" and report["images"] == 0


def test_each_generation_request_and_the_shutdown_are_logged(served, caplog):
    _, session, _ = served
    with caplog.at_level(logging.INFO, logger="memfit.serve"), TestClient(create_app(session)) as client:
        assert client.post("/sdapi/v1/txt2img", json={**BASE, "force_task_id": "logged"}).status_code == 200
        assert client.post("/sdapi/v1/txt2img", json={**BASE, "prompt": " "}).status_code == 422
    lines = [record.getMessage() for record in caplog.records if record.name == "memfit.serve"]
    assert re.fullmatch(r"txt2img logged: 32x32, 2 steps, 1 image\(s\): 200 done in \d+\.\d\d s, peak \d+\.\d\d [MG]iB",
                        lines[0]), lines
    assert lines[1].startswith("txt2img -: 32x32, 2 steps: 422 refused in ") and 'JSON field "prompt"' in lines[1]
    assert lines[-1] == "stopped after answering 1 generation requests (1 images)"


def test_every_serve_flag_that_takes_a_value_shows_its_default_in_help(capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    blocks = re.split(r"\n  (?=--)", capsys.readouterr().out)
    for flag in ("--dtype", "--budget", "--host", "--port", "--max-steps", "--max-pixels", "--max-images", "--max-body",
                 "--max-prompt-chars", "--max-seconds", "--shutdown-grace"):
        block = next(block for block in blocks if block.startswith(flag + " "))
        assert "default" in block, block


def test_img2img_on_an_editing_family_ignores_the_strength_a1111_always_sends(tiny_models):
    """FLUX.1 Kontext edits its input image rather than noising it: the denoising_strength A1111's clients send
    with every img2img request is left out, and the image is memfit generate's with --image alone."""
    import memfit
    from memfit.run.media import png_bytes
    from memfit.testing.conditioning import test_image

    model = tiny_models("flux_kontext")
    image = test_image(32, seed=3)
    expected = memfit.generate("a red circle", model=model, steps=2, seed=4, image=image, progress=False)
    with TestClient(create_app(Session(model))) as client:
        response = client.post("/sdapi/v1/img2img", json={"prompt": "a red circle", "steps": 2, "seed": 4,
                                                          "cfg_scale": expected.settings.guidance,
                                                          "init_images": [b64_png(image)], "denoising_strength": 0.75})
        assert response.status_code == 200, response.text
        assert base64.b64decode(response.json()["images"][0]) == png_bytes(expected.images[0], expected.metadata)


@pytest.mark.parametrize("kind", ["qwenimage_edit", "flux_fill"])
def test_img2img_on_families_that_need_an_image_answers_as_memfit_generate(tiny_models, kind):
    """Qwen-Image-Edit (whose text encoder sees the image with the prompt) and FLUX.1 Fill (image and mask on every
    run) through the img2img endpoint: the image memfit generate makes from the same image (and mask)."""
    import memfit
    from memfit.run.media import png_bytes
    from memfit.testing.conditioning import test_image, test_mask

    model = tiny_models(kind)
    image = test_image(64, seed=3)  # Qwen-Image-Edit sizes its output in multiples of 64
    mask = test_mask(64) if kind == "flux_fill" else None
    expected = memfit.generate("a red circle", model=model, steps=2, seed=4, image=image, mask=mask, progress=False)
    request = {"prompt": "a red circle", "steps": 2, "seed": 4, "cfg_scale": expected.settings.guidance,
               "init_images": [b64_png(image)], "denoising_strength": 1.0}
    if mask is not None:
        request["mask"] = b64_png(mask)
    with TestClient(create_app(Session(model))) as client:
        response = client.post("/sdapi/v1/img2img", json=request)
        assert response.status_code == 200, response.text
        assert base64.b64decode(response.json()["images"][0]) == png_bytes(expected.images[0], expected.metadata)
        without = client.post("/sdapi/v1/txt2img", json={"prompt": "a red circle", "steps": 2})
        assert without.status_code == 422 and "--image" in without.json()["detail"], without.text


def test_img2img_takes_several_init_images_where_the_model_does(tiny_models):
    """Qwen-Image-Edit-Plus edits with several images: every one of init_images goes to it, in order, as
    memfit generate's repeated --image; a model that takes one answers 422 for two."""
    import memfit
    from memfit.run.media import png_bytes
    from memfit.testing.conditioning import test_image

    images = [test_image(64, seed=3), test_image(64, seed=5)]
    model = tiny_models("qwenimage_edit_plus")
    expected = memfit.generate("a red circle", model=model, steps=2, seed=4, image=images, progress=False)
    request = {"prompt": "a red circle", "steps": 2, "seed": 4, "cfg_scale": expected.settings.guidance,
               "init_images": [b64_png(image) for image in images]}
    with TestClient(create_app(Session(model))) as client:
        response = client.post("/sdapi/v1/img2img", json=request)
        assert response.status_code == 200, response.text
        assert base64.b64decode(response.json()["images"][0]) == png_bytes(expected.images[0], expected.metadata)
    with TestClient(create_app(Session(tiny_models("qwenimage_edit")))) as client:
        response = client.post("/sdapi/v1/img2img", json=request)
        assert response.status_code == 422 and "init_images has 2 images" in response.json()["detail"], response.text
