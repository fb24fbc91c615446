"""The HTTP app: AUTOMATIC1111's web API (/sdapi/v1/*), memfit's reports, and a web page at /.

Field names and types follow AUTOMATIC1111's API (modules/api/models.py there), so its clients and
scripts work unchanged. Where memfit differs it says so in the response or refuses with a 422 that
says what to do: a field left out (steps, cfg_scale, width, height) takes the model's own default
rather than A1111's fixed 50 steps at 512x512; a sampler with no diffusers equivalent is refused;
fields memfit does not act on are listed in info's "memfit.ignored_fields" instead of silently
changing nothing. Each image is one memfit.generate run with seed, seed+1, ... (A1111's seeds for a
batch), so every image equals what `memfit generate` writes for its seed, PNG metadata included.
/sdapi/v1/img2img is the same request with an init image (and a mask to inpaint): the same job path,
each image equal to what `memfit generate --image --strength [--mask]` writes.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import io
import json
import secrets
import time
from dataclasses import dataclass
from importlib import resources
from typing import Any

from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import HTMLResponse, JSONResponse
from pydantic import BaseModel, ConfigDict

from memfit.errors import MemfitError
from memfit.models.families import Conditioning
from memfit.run.generate import check_conditioning
from memfit.run.samplers import SAMPLERS, resolve_sampler, sampler_names
from memfit.run.session import Session
from memfit.serve.jobs import Job, JobQueue
from memfit.version import __version__

__all__ = ["Img2ImgRequest", "Limits", "Txt2ImgRequest", "create_app"]

MAX_SEED = 2**32 - 1  # A1111 draws random seeds below 2**32


@dataclass(frozen=True)
class Limits:
    """Bounds on what one request may ask for (memfit serve --max-steps/--max-pixels/--max-images)."""

    max_steps: int = 150
    max_pixels: int = 2048 * 2048
    max_images: int = 8


class Txt2ImgRequest(BaseModel):
    """POST /sdapi/v1/txt2img, as AUTOMATIC1111's StableDiffusionTxt2ImgProcessingAPI names it."""

    model_config = ConfigDict(extra="allow")

    prompt: str = ""
    negative_prompt: str = ""
    steps: int | None = None
    cfg_scale: float | None = None
    width: int | None = None
    height: int | None = None
    seed: int = -1
    batch_size: int = 1
    n_iter: int = 1
    sampler_name: str | None = None
    sampler_index: str | None = None  # A1111's older name for sampler_name
    scheduler: str | None = None  # A1111 1.9+: "Automatic" or "Karras" (appended to the sampler's name)
    force_task_id: str | None = None  # the id /progress?id_task= and /memfit/v1/report/ know the job by
    send_images: bool = True
    save_images: bool = False


class Img2ImgRequest(Txt2ImgRequest):
    """POST /sdapi/v1/img2img, as AUTOMATIC1111's StableDiffusionImg2ImgProcessingAPI names it: the
    txt2img fields plus the init image, how far it is noised, and an optional inpainting mask."""

    init_images: list[str] | None = None  # base64 images, with or without a "data:image/...;base64," prefix
    denoising_strength: float = 0.75  # memfit generate's --strength; 0.75 is A1111's default (the pipeline's is 0.8)
    mask: str | None = None  # base64; white is repainted, black kept


# Fields A1111 clients send with their defaults; only a value other than these is reported as ignored.
HARMLESS_DEFAULTS = {"styles": [], "subseed": -1, "subseed_strength": 0, "seed_resize_from_h": -1,
                     "seed_resize_from_w": -1, "restore_faces": False, "tiling": False, "do_not_save_samples": False,
                     "do_not_save_grid": False, "enable_hr": False, "denoising_strength": None, "eta": None,
                     "s_churn": None, "s_tmax": None, "s_tmin": None, "s_noise": None, "override_settings": {},
                     "override_settings_restore_afterwards": True, "script_args": [], "script_name": None,
                     "alwayson_scripts": {}, "comments": {}, "infotext": None, "firstpass_image": None,
                     "refiner_checkpoint": None, "refiner_switch_at": None, "disable_extra_networks": False,
                     "hr_scale": 2, "hr_upscaler": None, "hr_second_pass_steps": 0, "hr_resize_x": 0,
                     "hr_resize_y": 0, "hr_checkpoint_name": None, "hr_sampler_name": None, "hr_scheduler": None,
                     "hr_prompt": "", "hr_negative_prompt": "", "clip_skip": None, "clip_skip_1": None}

# img2img fields memfit does not act on, with the values that change nothing in A1111 either; any other
# value is reported as ignored (None, A1111's "not set", never is). Those in MASK_ONLY act only on
# inpainting, so without a mask any value is harmless. inpainting_fill has no harmless value: diffusers'
# inpaint pipeline fills the masked area its own way.
IMG2IMG_HARMLESS = {"resize_mode": 0, "include_init_images": False, "mask_blur": 0, "mask_blur_x": 0,
                    "mask_blur_y": 0, "inpainting_fill": object(), "inpaint_full_res": False,
                    "inpaint_full_res_padding": 0, "inpainting_mask_invert": 0, "initial_noise_multiplier": None,
                    "image_cfg_scale": None, "latent_mask": None, "mask_round": True}
MASK_ONLY = {"mask_blur", "mask_blur_x", "mask_blur_y", "inpainting_fill", "inpaint_full_res",
             "inpaint_full_res_padding", "inpainting_mask_invert", "latent_mask", "mask_round"}


def create_app(session: Session, *, limits: Limits = Limits(), auth: str | None = None) -> FastAPI:
    """The app serving ``session``'s model. ``auth`` ("user:password") turns on HTTP basic auth for
    every route, as A1111's --api-auth does."""
    queue = JobQueue(session)
    folder = session.folder
    title = folder.path.name or str(folder.path)
    own_scheduler = folder.components.get("scheduler", ("", ""))[1]

    async def lifespan(app):
        yield
        await asyncio.to_thread(queue.stop)  # waiting jobs cancelled; the running one finishes first

    app = FastAPI(title="memfit serve", version=__version__, lifespan=lifespan)
    app.state.queue = queue
    app.state.session = session

    if auth is not None:
        expected = "Basic " + base64.b64encode(auth.encode()).decode()

        @app.middleware("http")
        async def basic_auth(request: Request, call_next):
            given = request.headers.get("authorization", "")
            if not secrets.compare_digest(given.encode(), expected.encode()):
                return JSONResponse({"detail": "Not authenticated"}, status_code=401,
                                    headers={"WWW-Authenticate": 'Basic realm="memfit"'})
            return await call_next(request)

    # ---- A1111 API ---------------------------------------------------------------------------
    @app.post("/sdapi/v1/txt2img")
    async def txt2img(body: Txt2ImgRequest, request: Request):
        return await _serve(body, request)

    @app.post("/sdapi/v1/img2img")
    async def img2img(body: Img2ImgRequest, request: Request):
        if not body.init_images:
            raise HTTPException(422, "init_images needs one base64 image (the image to start from); for text to "
                                     "image use /sdapi/v1/txt2img.")
        if len(body.init_images) > 1:
            raise HTTPException(422, f"init_images has {len(body.init_images)} images; memfit takes one per request "
                                     "(batch_size and n_iter make several images from it).")
        conditioning = Conditioning(image=_decode_image(body.init_images[0], "init_images[0]", "RGB"),
                                    mask_image=None if body.mask is None else _decode_image(body.mask, "mask", None))
        return await _serve(body, request, conditioning, body.denoising_strength)

    async def _serve(body: Txt2ImgRequest, request: Request, conditioning: Conditioning | None = None,
                     strength: float | None = None):
        """One request's job, queued, waited for and answered (txt2img and img2img alike)."""
        runs, seeds, sampler = _runs(body, conditioning, strength)
        job = Job(runs, **({"id": body.force_task_id} if body.force_task_id else {}))
        if body.force_task_id and queue.get(body.force_task_id) is not None:
            raise HTTPException(422, f"force_task_id {body.force_task_id!r} is already in use; send a new id or none.")
        try:
            queue.submit(job)
        except MemfitError as exc:
            raise HTTPException(503, str(exc)) from exc
        await _wait(job, request)
        if job.state == "failed":
            raise HTTPException(422 if job.error_is_input else 500, job.error)
        if job.state == "cancelled":
            raise HTTPException(503, job.error or "The request was cancelled before it ran.")
        first = runs[0]
        info = {
            "prompt": body.prompt, "all_prompts": [body.prompt] * len(job.images),
            "negative_prompt": body.negative_prompt, "all_negative_prompts": [body.negative_prompt] * len(job.images),
            "seed": seeds[0], "all_seeds": seeds[:len(job.images)], "subseed": -1, "all_subseeds": [-1] * len(job.images),
            "subseed_strength": 0, "width": first["width"], "height": first["height"],
            "sampler_name": sampler or "Default", "cfg_scale": first["guidance"], "steps": first["steps"],
            "batch_size": body.batch_size, "n_iter": body.n_iter, "sd_model_name": title, "sd_model_hash": None,
            "seed_resize_from_w": -1, "seed_resize_from_h": -1, "denoising_strength": first.get("strength"),
            "restore_faces": False, "clip_skip": None, "job_timestamp": time.strftime("%Y%m%d%H%M%S"),
            "infotexts": [_infotext(body.prompt, body.negative_prompt, run, sampler, title) for run in runs[:len(job.images)]],
            "version": f"memfit {__version__}",
            "memfit": {"job": job.id, "state": job.state, "report": f"/memfit/v1/report/{job.id}",
                       "interrupted": job.state == "interrupted", "ignored_fields": _ignored(body, conditioning),
                       "seconds": round((job.finished or time.time()) - job.started, 3) if job.started else None},
        }
        images = [base64.b64encode(png).decode() for png in job.images] if body.send_images else []
        parameters = body.model_dump()
        if isinstance(body, Img2ImgRequest):
            parameters.update(init_images=None, mask=None)  # as A1111 without include_init_images
        return {"images": images, "parameters": parameters, "info": json.dumps(info)}

    @app.get("/sdapi/v1/progress")
    async def progress(skip_current_image: bool = False, id_task: str | None = None):
        running = queue.running
        job = queue.get(id_task) if id_task else running
        shown = job if job is not None else running
        position = queue.position(job) if job is not None else None
        state = {"skipped": False, "interrupted": bool(shown and shown.stop_requested), "stopping_generation": False,
                 "job": shown.id if shown else "", "job_count": queue.waiting() + (1 if running else 0),
                 "job_timestamp": time.strftime("%Y%m%d%H%M%S", time.localtime(shown.created)) if shown else "0",
                 "job_no": shown.image_index if shown else 0, "sampling_step": shown.step if shown else 0,
                 "sampling_steps": shown.steps if shown else 0}
        return {"progress": round(shown.progress, 4) if shown and shown.state != "queued" else 0.0,
                "eta_relative": round(shown.eta(), 3) if shown else 0.0, "state": state, "current_image": None,
                "textinfo": None,
                "memfit": {"queue_length": queue.waiting(), "running": running.id if running else None,
                           "job": job.id if job else None, "job_state": job.state if job else None,
                           "queue_position": position}}

    @app.post("/sdapi/v1/interrupt")
    async def interrupt():
        queue.interrupt()
        return {}

    @app.post("/sdapi/v1/skip")
    async def skip():
        queue.interrupt()  # one image per run: skipping the current image ends the job, as interrupt does
        return {}

    @app.get("/sdapi/v1/sd-models")
    async def sd_models():
        return [{"title": title, "model_name": title, "hash": None, "sha256": None, "filename": str(folder.path),
                 "config": None}]

    @app.get("/sdapi/v1/samplers")
    async def samplers():
        return [{"name": name, "aliases": [], "options": {}} for name in sampler_names(own_scheduler)]

    @app.get("/sdapi/v1/options")
    async def get_options():
        return {"sd_model_checkpoint": title, "sd_checkpoint_hash": None, "samples_format": "png",
                "memfit_pipeline": folder.class_name, "memfit_dtype": session.dtype,
                "memfit_device": str(session.device),
                "memfit_budget": None if session.budget is None else str(session.budget),
                "memfit_limits": limits.__dict__}

    @app.post("/sdapi/v1/options")
    async def set_options(request: Request):
        options = await _json_object(request)
        checkpoint = options.get("sd_model_checkpoint")
        if checkpoint is not None and checkpoint != title:
            raise HTTPException(422, f"This server serves one model, {title!r}; start another memfit serve for "
                                     f"{checkpoint!r}.")
        return None

    # ---- memfit ------------------------------------------------------------------------------
    @app.get("/memfit/v1/report/{job_id}")
    async def report(job_id: str):
        job = queue.get(job_id)
        if job is None:
            raise HTTPException(404, f"No job {job_id!r}: the server keeps the last {queue.keep_finished} jobs.")
        return {"job": job.id, "state": job.state, "error": job.error, "images": len(job.images),
                "created_at": job.created, "started_at": job.started, "finished_at": job.finished,
                "queued_seconds": None if job.started is None else round(job.started - job.created, 3),
                "seconds": None if job.finished is None or job.started is None else round(job.finished - job.started, 3),
                "runs": job.reports, "warm": session.warm_state()}

    @app.get("/", response_class=HTMLResponse)
    async def page():
        return resources.files("memfit.serve").joinpath("page.html").read_text()

    # ---- request checks ----------------------------------------------------------------------
    def _runs(body: Txt2ImgRequest, conditioning: Conditioning | None = None,
              strength: float | None = None) -> tuple[list[dict[str, Any]], list[int], str | None]:
        """Session.generate arguments per image, the seeds, and the sampler; HTTP 422 for a request
        that cannot run, checked before it waits in the queue. ``conditioning`` (an init image and
        mask) and ``strength`` make it img2img or inpainting."""
        images = body.batch_size * body.n_iter
        if body.batch_size < 1 or body.n_iter < 1 or images > limits.max_images:
            raise HTTPException(422, f"batch_size x n_iter must be 1 to {limits.max_images} images, got "
                                     f"{body.batch_size} x {body.n_iter}; lower them (memfit serve --max-images raises it).")
        if body.seed < -1 or body.seed > MAX_SEED:
            raise HTTPException(422, f"seed must be -1 (random) or 0 to {MAX_SEED}, got {body.seed}.")
        sampler = _sampler(body)
        try:
            if conditioning is not None:  # memfit's own refusal for a family without img2img/inpainting
                check_conditioning(folder.adapter, conditioning, False)
            settings = folder.adapter.resolve(body.prompt, body.negative_prompt, body.steps, body.cfg_scale, 0,
                                              body.width, body.height, folder.defaults, conditioning=conditioning,
                                              strength=strength)
        except MemfitError as exc:
            raise HTTPException(422, str(exc)) from exc
        if settings.steps > limits.max_steps:
            raise HTTPException(422, f"steps must be at most {limits.max_steps}, got {settings.steps}; lower them "
                                     "(memfit serve --max-steps raises the limit).")
        if settings.width * settings.height > limits.max_pixels:
            raise HTTPException(422, f"{settings.width}x{settings.height} is more than the {limits.max_pixels} pixels a "
                                     "request may ask for; ask for a smaller size (memfit serve --max-pixels raises it).")
        seed = secrets.randbelow(MAX_SEED + 1) if body.seed == -1 else body.seed
        seeds = [(seed + i) % (MAX_SEED + 1) for i in range(images)]
        runs = [dict(prompt=settings.prompt, negative_prompt=settings.negative_prompt, steps=settings.steps,
                     guidance=settings.guidance, width=settings.width, height=settings.height, seed=s, sampler=sampler)
                for s in seeds]
        if conditioning is not None:
            # The size resolved from the image is what memfit generate --image resolves too.
            for run in runs:
                run.update(image=conditioning.image, mask=conditioning.mask_image, strength=settings.strength)
        return runs, seeds, sampler

    def _sampler(body: Txt2ImgRequest) -> str | None:
        name = body.sampler_name or body.sampler_index
        if name in (None, "", "Default"):
            if body.scheduler not in (None, "", "Automatic"):
                raise HTTPException(422, f"scheduler {body.scheduler!r} needs a sampler_name; name one (GET /sdapi/v1/samplers).")
            return None
        if body.scheduler == "Karras" and not name.endswith(" Karras"):
            if f"{name} Karras" not in SAMPLERS:
                raise HTTPException(422, f"The sampler {name!r} has no Karras schedule here; use scheduler Automatic.")
            name = f"{name} Karras"
        elif body.scheduler not in (None, "", "Automatic", "Karras"):
            raise HTTPException(422, f"scheduler {body.scheduler!r} is not supported; use Automatic or Karras.")
        try:
            resolve_sampler(name, own_scheduler)
        except MemfitError as exc:
            raise HTTPException(422, str(exc)) from exc
        return name

    return app


async def _wait(job: Job, request: Request) -> None:
    """Until ``job`` is finished; a client that goes away cancels it, so it never holds up the queue."""
    queue: JobQueue = request.app.state.queue
    while not job.done.is_set():
        if await request.is_disconnected():
            queue.cancel(job)
            return
        await asyncio.sleep(0.05)


async def _json_object(request: Request) -> dict:
    try:
        value = json.loads(await request.body() or b"{}")
    except (json.JSONDecodeError, UnicodeDecodeError, binascii.Error) as exc:
        raise HTTPException(422, f"The body is not JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise HTTPException(422, "The body must be a JSON object.")
    return value


def _decode_image(data: str, field: str, mode: str | None):
    """A PIL image from a base64 string (A1111's optional "data:image/png;base64," prefix allowed),
    opened as memfit generate opens an image file (``mode`` "RGB" for the init image, as is for a mask);
    HTTP 422 saying what is wrong otherwise."""
    from PIL import Image

    if data.startswith("data:"):
        data = data.partition(",")[2]
    try:
        raw = base64.b64decode("".join(data.split()), validate=True)
    except (binascii.Error, ValueError) as exc:
        raise HTTPException(422, f"{field} is not valid base64 ({exc}); send the image file's bytes base64-encoded, "
                                 "e.g. a PNG.") from None
    try:
        with Image.open(io.BytesIO(raw)) as opened:
            return opened.convert(mode) if mode else opened.copy()
    except (OSError, ValueError, Image.DecompressionBombError) as exc:
        raise HTTPException(422, f"{field} is not an image Pillow can read ({exc}); send a PNG or JPEG, "
                                 "base64-encoded.") from None


def _ignored(body: Txt2ImgRequest, conditioning: Conditioning | None = None) -> list[str]:
    extra = dict(body.model_extra or {})
    if isinstance(body, Img2ImgRequest):
        masked = conditioning is not None and conditioning.mask_image is not None
        for name in list(extra):
            harmless = name in IMG2IMG_HARMLESS and (not masked and name in MASK_ONLY
                                                     or IMG2IMG_HARMLESS[name] == extra[name])
            if harmless or (name in IMG2IMG_HARMLESS and extra[name] is None):
                del extra[name]
    ignored = [name for name, value in extra.items()
               if name in IMG2IMG_HARMLESS or HARMLESS_DEFAULTS.get(name, object()) != value]
    if body.save_images:
        ignored.append("save_images")  # the server writes no files; the client gets the images
    return sorted(ignored)


def _infotext(prompt: str, negative: str | None, run: dict, sampler: str | None, title: str) -> str:
    """A1111's one-line parameters text (what it writes into its PNGs' "parameters")."""
    lines = [prompt]
    if negative:
        lines.append(f"Negative prompt: {negative}")
    lines.append(f"Steps: {run['steps']}, Sampler: {sampler or 'Default'}, CFG scale: {run['guidance']}, "
                 f"Seed: {run['seed']}, Size: {run['width']}x{run['height']}, Model: {title}"
                 + (f", Denoising strength: {run['strength']}" if run.get("strength") is not None else ""))
    return "\n".join(lines)
