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

The other routes A1111's clients call answer in A1111's shapes: samplers and schedulers (what the
selected model can take), png-info, the checkpoint, VAE and LoRA lists and their rescans (of
--models-dir; memfit.serve.checkpoints), switching checkpoints (options, override_settings),
cmd-flags, memory, and extras upscaling with the upscalers that need no model (memfit.serve.upscale).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import html
import io
import json
import logging
import math
import secrets
import time
from dataclasses import dataclass, replace
from importlib import resources
from pathlib import Path
from typing import Any, Literal

from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import HTMLResponse
from pydantic import BaseModel, ConfigDict

from memfit.errors import MemfitError
from memfit.models.families import Conditioning
from memfit.models.folder import ModelFolder
from memfit.models.library import ModelEntry
from memfit.run.generate import check_conditioning
from memfit.run.media import png_bytes
from memfit.run.samplers import SAMPLERS, resolve_sampler, sampler_label, sampler_names, schedules_for, split_sampler
from memfit.run.session import Session
from memfit.serve.checkpoints import OWN_VAE, Checkpoints, describe_lora, short_name
from memfit.serve.costs import Measured, StepTimes, check_seconds
from memfit.serve.guards import BasicAuth, BodyLimit
from memfit.serve.infotext import image_text, infotext, read_parameters
from memfit.serve.jobs import Job, JobQueue
from memfit.serve.prompt_loras import prompt_loras
from memfit.serve.upscale import UPSCALERS, Upscale, upscale
from memfit.sizes import format_bytes
from memfit.version import __version__

__all__ = ["STOP_WAIT", "ExtrasSingleImageRequest", "Img2ImgRequest", "Limits", "Txt2ImgRequest", "create_app"]

MAX_SEED = 2**32 - 1  # A1111 draws random seeds below 2**32
# After the grace period a request still running at shutdown is stopped at its next cancellation point; one
# that reaches none (inside one long call) is waited for this much longer, then left behind.
STOP_WAIT = 10.0

log = logging.getLogger("memfit.serve")


@dataclass(frozen=True)
class Limits:
    """Bounds on what one request may ask for (memfit serve --max-steps, --max-pixels, --max-images, --max-body,
    --max-prompt-chars, --max-seconds). ``max_pixels`` bounds every image a request sends too (init image, mask,
    extras), read from its header before it is decoded. ``max_seconds`` bounds the denoising time estimated
    before a request is queued (memfit.serve.costs; None: no bound)."""

    max_steps: int = 150
    max_pixels: int = 2048 * 2048
    max_images: int = 8
    # An incompressible 2048x2048 RGB PNG is 12 MiB, 16 MiB as base64: an init image and a mask of that size fit.
    max_body_bytes: int = 48 * 2**20
    # Far above what any text encoder reads (CLIP 77 tokens, T5 512), and a few milliseconds to tokenize.
    max_prompt_chars: int = 20_000
    max_seconds: float | None = 600.0


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
    scheduler: str | None = None  # A1111 1.9+: a schedule type's name or label ("karras", "Karras"); None: automatic
    force_task_id: str | None = None  # the id /progress?id_task= and /memfit/v1/report/ know the job by
    send_images: bool = True
    save_images: bool = False


class Img2ImgRequest(Txt2ImgRequest):
    """POST /sdapi/v1/img2img, as AUTOMATIC1111's StableDiffusionImg2ImgProcessingAPI names it: the
    txt2img fields plus the init image, how far it is noised, and an optional inpainting mask."""

    init_images: list[str] | None = None  # base64 images, with or without a "data:image/...;base64," prefix
    denoising_strength: float = 0.75  # memfit generate's --strength; 0.75 is A1111's default (the pipeline's is 0.8)
    mask: str | None = None  # base64; white is repainted, black kept


class PngInfoRequest(BaseModel):
    """POST /sdapi/v1/png-info."""

    image: str  # base64, with or without a "data:image/...;base64," prefix


class ExtrasSingleImageRequest(BaseModel):
    """POST /sdapi/v1/extra-single-image, as AUTOMATIC1111's ExtrasSingleImageRequest names it."""

    model_config = ConfigDict(extra="allow")

    image: str
    resize_mode: Literal[0, 1] = 0  # 0: scale by upscaling_resize; 1: scale to upscaling_resize_w x _h
    show_extras_results: bool = True
    gfpgan_visibility: float = 0
    codeformer_visibility: float = 0
    codeformer_weight: float = 0
    upscaling_resize: float = 2
    upscaling_resize_w: int = 512
    upscaling_resize_h: int = 512
    upscaling_crop: bool = True
    upscaler_1: str = "None"
    upscaler_2: str = "None"
    extras_upscaler_2_visibility: float = 0
    upscale_first: bool = False


# Fields A1111 clients send that memfit does not act on, with the values that change nothing in A1111
# either (its own defaults, and what its settings make of None); only another value is reported as
# ignored. Those in HIRES_ONLY act only with enable_hr, so without it any value is harmless.
HARMLESS = {"styles": ([],), "subseed": (-1,), "subseed_strength": (0,), "seed_resize_from_h": (-1, 0),
            "seed_resize_from_w": (-1, 0), "restore_faces": (False, None), "tiling": (False, None),
            "do_not_save_samples": (False,), "do_not_save_grid": (False,), "enable_hr": (False,),
            "s_churn": (None, 0), "s_tmax": (None, 0), "s_tmin": (None, 0), "s_noise": (None, 1),
            "override_settings": ({}, None), "override_settings_restore_afterwards": (True, False), "script_args": ([],),
            "script_name": (None,), "alwayson_scripts": ({},), "comments": ({},), "infotext": (None,),
            "refiner_checkpoint": (None,), "refiner_switch_at": (None,), "disable_extra_networks": (False,),
            "clip_skip": (None,), "clip_skip_1": (None,)}
HIRES_ONLY = {"denoising_strength", "firstphase_width", "firstphase_height", "firstpass_image", "hr_scale",
              "hr_upscaler", "hr_second_pass_steps", "hr_resize_x", "hr_resize_y", "hr_checkpoint_name",
              "hr_sampler_name", "hr_scheduler", "hr_prompt", "hr_negative_prompt", "hr_cfg"}
# A1111's eta when a request leaves it out: eta_ddim (0) for DDIM, eta_ancestral (1) for the others
# (the samplers without noise of their own take no eta at all).
ETA_DEFAULT = {"DDIM": 0}

# img2img fields memfit does not act on, with the values that change nothing in A1111 either; any other
# value is reported as ignored (None, A1111's "not set", never is). Those in MASK_ONLY act only on
# inpainting, so without a mask any value is harmless. inpainting_fill has no harmless value: diffusers'
# inpaint pipeline fills the masked area its own way.
IMG2IMG_HARMLESS = {"resize_mode": (0,), "include_init_images": (False,), "mask_blur": (0,), "mask_blur_x": (0,),
                    "mask_blur_y": (0,), "inpainting_fill": (), "inpaint_full_res": (False,),
                    "inpaint_full_res_padding": (0,), "inpainting_mask_invert": (0,),
                    "initial_noise_multiplier": (1,), "image_cfg_scale": (1.5,), "latent_mask": (),
                    "mask_round": (True,)}
# The settings memfit acts on, in POST /sdapi/v1/options and a request's override_settings.
SETTINGS_ACTED_ON = ("sd_model_checkpoint", "sd_vae", "forge_additional_modules")
MASK_ONLY = {"mask_blur", "mask_blur_x", "mask_blur_y", "inpainting_fill", "inpaint_full_res",
             "inpaint_full_res_padding", "inpainting_mask_invert", "latent_mask", "mask_round"}


def create_app(served: Session | Checkpoints, *, limits: Limits = Limits(), auth: str | None = None,
               flags: dict[str, Any] | None = None, shutdown_grace: float = 30.0) -> FastAPI:
    """The app serving ``served``: a Session's model alone, or the Checkpoints of a models folder (switched
    between by request). ``auth`` ("user:password") turns on HTTP basic auth for every route, as
    A1111's --api-auth does. ``flags``: what only the command line knows (where it listens, how it
    loads), added to /sdapi/v1/cmd-flags. ``shutdown_grace``: the seconds a request still running when
    the server stops has to finish before it is stopped at its next cancellation point."""
    checkpoints = served if isinstance(served, Checkpoints) else Checkpoints(served)
    queue = JobQueue(checkpoints)
    step_times = StepTimes()
    # The options memfit keeps besides the checkpoint; forge_additional_modules: the module files chosen for it.
    settings: dict[str, Any] = {"sd_vae": "Automatic", "forge_additional_modules": ()}
    answered = {"requests": 0, "images": 0}

    async def lifespan(app):
        yield
        if await asyncio.to_thread(queue.stop, shutdown_grace + STOP_WAIT, grace=shutdown_grace):
            checkpoints.close()
        else:  # stuck inside one call: its stages are freed with the process
            log.info("the running request reached no cancellation point %g s after the shutdown began; "
                     "exiting without it", shutdown_grace + STOP_WAIT)
        log.info("stopped after answering %d generation requests (%d images)", answered["requests"],
                 answered["images"])

    app = FastAPI(title="memfit serve", version=__version__, lifespan=lifespan)
    app.state.queue = queue
    app.state.checkpoints = checkpoints
    app.state.step_times = step_times
    app.add_middleware(BodyLimit, max_bytes=limits.max_body_bytes)
    if auth is not None:  # added last, so it runs first: no body is read for a client that is not let in
        app.add_middleware(BasicAuth, credentials=auth)

    # ---- A1111 API ---------------------------------------------------------------------------
    @app.post("/sdapi/v1/txt2img")
    async def txt2img(body: Txt2ImgRequest, request: Request):
        return await _logged("txt2img", body, request, _serve(body, request))

    @app.post("/sdapi/v1/img2img")
    async def img2img(body: Img2ImgRequest, request: Request):
        return await _logged("img2img", body, request, _serve(body, request))

    async def _logged(route: str, body: Txt2ImgRequest, request: Request, answer):
        """What ``answer`` (a generation request's work) returns, with one log line for the request."""
        started = time.time()
        try:
            result = await answer
        except HTTPException as exc:
            log.info(_request_line(route, body, getattr(request.state, "job", None), exc.status_code,
                                   time.time() - started, str(exc.detail)))
            raise
        job = request.state.job
        answered["requests"] += 1
        answered["images"] += len(job.images)
        gone = "the client went away" if request.state.client_left else ""
        log.info(_request_line(route, body, job, 200, time.time() - started, gone))
        return result

    async def _serve(body: Txt2ImgRequest, request: Request):
        """One request's job, checked, queued, waited for and answered: txt2img, or img2img for an Img2ImgRequest."""
        _check_prompts(body)
        conditioning = await _conditioning(body) if isinstance(body, Img2ImgRequest) else None
        entry, vae, modules = await _overridden(body)
        folder = await _opened(entry, vae, modules)
        notes = []
        if conditioning is not None:
            conditioning, notes = await _init_images_sized(conditioning, folder)
        runs, seeds, sampler = _runs(body, folder, conditioning,
                                    None if conditioning is None else body.denoising_strength)
        estimate, check_pace = _priced(entry, folder, runs)
        for run in runs:
            run["checkpoint"], run["vae"], run["modules"] = entry, vae, modules
        job = Job(runs, check_pace=check_pace, **({"id": body.force_task_id} if body.force_task_id else {}))
        if body.force_task_id and queue.get(body.force_task_id) is not None:
            raise HTTPException(422, f"force_task_id {body.force_task_id!r} is already in use; send a new id or none.")
        try:
            queue.submit(job)
        except MemfitError as exc:
            raise HTTPException(503, str(exc)) from exc
        request.state.job = job
        request.state.client_left = not await _wait(job, request)
        first = runs[0]
        if job.seconds_per_step is not None:
            step_times.record(entry.path, Measured(first["width"], first["height"], job.seconds_per_step))
        if job.state == "failed":
            raise HTTPException(422 if job.error_is_input else 500, job.error)
        if job.state == "cancelled":
            raise HTTPException(503, job.error or "The request was cancelled before it ran.")
        base_sampler = split_sampler(sampler, None, _own_scheduler(folder))[0] if sampler else None
        digest = checkpoints.sha256(entry)
        info = {
            "prompt": body.prompt, "all_prompts": [body.prompt] * len(job.images),
            "negative_prompt": body.negative_prompt, "all_negative_prompts": [body.negative_prompt] * len(job.images),
            "seed": seeds[0], "all_seeds": seeds[:len(job.images)], "subseed": -1, "all_subseeds": [-1] * len(job.images),
            "subseed_strength": 0, "width": first["width"], "height": first["height"],
            "sampler_name": sampler or "Default", "cfg_scale": first["guidance"], "steps": first["steps"],
            "batch_size": body.batch_size, "n_iter": body.n_iter, "sd_model_name": short_name(entry),
            "sd_model_hash": digest[:10] if digest else None,
            "seed_resize_from_w": -1, "seed_resize_from_h": -1, "denoising_strength": first.get("strength"),
            "restore_faces": False, "clip_skip": None, "job_timestamp": time.strftime("%Y%m%d%H%M%S"),
            "infotexts": [infotext(body.prompt, body.negative_prompt, run, sampler, folder.path.name)
                          for run in runs[:len(job.images)]],
            "version": f"memfit {__version__}",
            "memfit": {"job": job.id, "state": job.state, "report": f"/memfit/v1/report/{job.id}",
                       "interrupted": job.state == "interrupted", "ignored_fields": _ignored(body, conditioning, base_sampler),
                       "seconds": round((job.finished or time.time()) - job.started, 3) if job.started else None,
                       "estimated_seconds": None if estimate is None else round(estimate, 3), "notes": notes},
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
        return [checkpoints.describe(entry) for entry in checkpoints.servable()]

    @app.get("/sdapi/v1/sd-vae")
    async def sd_vae():
        return [{"model_name": vae.name, "filename": str(vae.path)} for vae in checkpoints.listing.vaes]

    @app.get("/sdapi/v1/sd-modules")
    async def sd_modules():
        """Forge's list of the files that may replace a checkpoint's VAE or text encoders (forge_additional_modules)."""
        return [{"model_name": module.name, "filename": str(module.path)} for module in checkpoints.listing.modules()]

    @app.get("/sdapi/v1/loras")
    async def loras():
        return await asyncio.to_thread(lambda: [describe_lora(lora) for lora in checkpoints.listing.loras])

    async def rescan():
        await asyncio.to_thread(checkpoints.refresh)

    for path in ("refresh-checkpoints", "refresh-loras", "refresh-vae"):
        app.add_api_route(f"/sdapi/v1/{path}", rescan, methods=["POST"])

    @app.get("/sdapi/v1/samplers")
    async def samplers():
        own = _own_scheduler(await _opened(checkpoints.selected))
        return [{"name": name, "aliases": list(SAMPLERS[name][2]),
                 "options": {"memfit_scheduler": resolve_sampler(name, own)[0]}} for name in sampler_names(own)]

    @app.get("/sdapi/v1/schedulers")
    async def schedulers():
        return [{"name": s.name, "label": s.label, "aliases": list(s.aliases) or None, "default_rho": s.default_rho,
                 "need_inner_model": s.need_inner_model}
                for s in schedules_for(_own_scheduler(await _opened(checkpoints.selected)))]

    @app.get("/sdapi/v1/upscalers")
    async def upscalers():
        return [{"name": name, "model_name": None, "model_path": None, "model_url": None, "scale": 4}
                for name in UPSCALERS]

    @app.post("/sdapi/v1/png-info")
    async def png_info(body: PngInfoRequest):
        text, items, parameters = read_parameters(await _image(body.image, "image", None))
        return {"info": text, "items": items, "parameters": parameters}

    @app.post("/sdapi/v1/extra-single-image")
    async def extra_single_image(body: ExtrasSingleImageRequest):
        if body.gfpgan_visibility > 0 or body.codeformer_visibility > 0:
            raise HTTPException(422, "memfit has no face restorers (GET /sdapi/v1/face-restorers lists none); send "
                                     "gfpgan_visibility and codeformer_visibility 0.")
        image = await _image(body.image, "image", None)
        job = Upscale(body.upscaler_1, body.resize_mode, body.upscaling_resize, body.upscaling_resize_w,
                      body.upscaling_resize_h, body.upscaling_crop, body.upscaler_2, body.extras_upscaler_2_visibility)
        try:
            job.check(image.size, limits.max_pixels)
        except MemfitError as exc:
            raise HTTPException(422, str(exc)) from exc
        result, notes = await asyncio.to_thread(upscale, image, job)
        text = ", ".join(f"{key}: {value}" for key, value in notes.items())
        # The PNG keeps the input's own text (its parameters, memfit's chunks) and says what was done, as A1111's.
        png = png_bytes(result, {**image_text(image), "postprocessing": text})
        return {"image": base64.b64encode(png).decode(), "html_info": f"<p>{html.escape(text)}</p>"}

    @app.get("/sdapi/v1/cmd-flags")
    async def cmd_flags():
        session = checkpoints.session
        library = checkpoints.library
        return {"api": True, "nowebui": False, "model": str(checkpoints.selected.path),
                "models_dir": str(library.root) if library else None, "dtype": session.dtype,
                "device": str(session.device), "budget": None if session.budget is None else str(session.budget),
                "no_warm": session.pool is None, "max_steps": limits.max_steps, "max_pixels": limits.max_pixels,
                "max_images": limits.max_images, "max_body": limits.max_body_bytes,
                "max_prompt_chars": limits.max_prompt_chars, "max_seconds": limits.max_seconds,
                "shutdown_grace": shutdown_grace, "api_auth": None if auth is None else "<set>", **(flags or {})}

    @app.get("/sdapi/v1/memory")
    async def memory():
        return {"ram": _host_memory(), "cuda": _device_memory(checkpoints.session.device)}

    @app.get("/sdapi/v1/scripts")
    async def scripts():
        return {"txt2img": [], "img2img": []}

    @app.get("/sdapi/v1/embeddings")
    async def embeddings():
        return {"loaded": {}, "skipped": {}}

    # memfit has no folders of embeddings, hypernetworks, styles or upscaler models to list, nor to rescan.
    async def nothing_listed():
        return []

    async def nothing_to_refresh():
        return None

    for path in ("hypernetworks", "face-restorers", "realesrgan-models", "prompt-styles", "latent-upscale-modes",
                 "script-info"):
        app.add_api_route(f"/sdapi/v1/{path}", nothing_listed, methods=["GET"])
    app.add_api_route("/sdapi/v1/refresh-embeddings", nothing_to_refresh, methods=["POST"])

    @app.get("/sdapi/v1/options")
    async def get_options():
        session = checkpoints.session
        selected = checkpoints.selected
        return {"sd_model_checkpoint": checkpoints.title(selected), "sd_checkpoint_hash": checkpoints.sha256(selected),
                "sd_vae": settings["sd_vae"],
                "forge_additional_modules": [str(path) for path in settings["forge_additional_modules"]],
                "samples_format": "png", "memfit_pipeline": selected.pipeline,
                "memfit_dtype": session.dtype, "memfit_device": str(session.device),
                "memfit_budget": None if session.budget is None else str(session.budget),
                "memfit_limits": limits.__dict__}

    @app.post("/sdapi/v1/options")
    async def set_options(request: Request):
        options = await _json_object(request)
        vae = _vae(options, "sd_vae")
        files = _module_files(options, "forge_additional_modules")
        checkpoint = options.get("sd_model_checkpoint")
        if checkpoint is not None or vae is not None or files is not None:
            entry = checkpoints.selected if checkpoint is None else _find(checkpoint, "sd_model_checkpoint")
            files = _kept_modules(entry) if files is None else files
            modules = await _modules(entry, files, "forge_additional_modules")
            try:  # waits for the running request, as A1111's switch does
                await asyncio.to_thread(checkpoints.select, entry, checkpoints.vae_file(vae or settings["sd_vae"]),
                                        modules)
            except MemfitError as exc:
                raise HTTPException(422, f"sd_vae {vae!r} cannot be used with {checkpoints.title(entry)!r}: {exc}"
                                    if vae is not None and vae not in OWN_VAE else str(exc)) from exc
            settings["forge_additional_modules"] = files
        if vae is not None:
            settings["sd_vae"] = vae
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
                "runs": job.reports, "warm": checkpoints.session.warm_state()}

    @app.get("/memfit/v1/models")
    async def models():
        """Every checkpoint found, those memfit cannot serve with the reason (A1111's list leaves them out)."""
        library = checkpoints.library
        return {"models_dir": str(library.root) if library else None,
                "selected": checkpoints.title(checkpoints.selected), "loaded": checkpoints.title(checkpoints.current),
                "checkpoints": [{"title": checkpoints.title(entry), "name": entry.name, "kind": entry.kind,
                                 "filename": str(entry.path), "pipeline": entry.pipeline or None,
                                 "sha256": checkpoints.sha256(entry), "error": entry.error or None,
                                 "components": {name: str(path) for name, path in entry.components},
                                 "candidates": {name: [str(path) for path in paths] for name, paths in entry.candidates}}
                                for entry in checkpoints.listing.checkpoints]}

    @app.get("/", response_class=HTMLResponse)
    async def page():
        return resources.files("memfit.serve").joinpath("page.html").read_text()

    # ---- request checks ----------------------------------------------------------------------
    def _check_prompts(body: Txt2ImgRequest) -> None:
        """HTTP 422 for a prompt over --max-prompt-chars, before anything else is done with the request."""
        for field in ("prompt", "negative_prompt"):
            length = len(getattr(body, field))
            if length > limits.max_prompt_chars:
                raise HTTPException(422, f"{field} has {length} characters, more than the {limits.max_prompt_chars} a "
                                         "request may send (text encoders read far fewer); shorten it (memfit serve "
                                         "--max-prompt-chars raises the limit).")

    async def _conditioning(body: Img2ImgRequest) -> Conditioning:
        """The init image and mask of an img2img request, decoded off the event loop; HTTP 422 saying what is wrong."""
        if not body.init_images:
            raise HTTPException(422, "init_images needs one base64 image (the image to start from); for text to "
                                     "image use /sdapi/v1/txt2img.")
        images = [await _image(data, f"init_images[{index}]", "RGB") for index, data in enumerate(body.init_images)]
        return Conditioning(image=images[0] if len(images) == 1 else images,
                            mask_image=None if body.mask is None else await _image(body.mask, "mask", None))

    async def _init_images_sized(conditioning: Conditioning, folder: ModelFolder) -> tuple[Conditioning, list[str]]:
        """``conditioning`` with each init image sized for ``folder``'s model (_init_image_sized), and the notes;
        HTTP 422 for several where the model takes one."""
        several = isinstance(conditioning.image, list)
        images = conditioning.image if several else [conditioning.image]
        if several and not folder.adapter.takes_several_images:
            raise HTTPException(422, f"init_images has {len(images)} images; {folder.class_name} takes one per request "
                                     "(batch_size and n_iter make several images from it).")
        sized = [await _init_image_sized(image, folder, f"init_images[{index}]") for index, image in enumerate(images)]
        notes = [note for _, image_notes in sized for note in image_notes]
        return replace(conditioning, image=[image for image, _ in sized] if several else sized[0][0]), notes

    async def _image(data: str, field: str, mode: str | None):
        """A request's base64 image, its size checked from its header and then decoded in a thread: a large
        image never holds up the event loop (and every other client with it)."""
        return await asyncio.to_thread(_decode_image, data, field, mode, limits.max_pixels)

    async def _init_image_sized(image, folder: ModelFolder, field: str):
        """``image`` with its sides rounded down to what ``folder``'s model takes, and notes for the answer's info
        saying so where they were not: A1111 draws an init image at a size the model takes too (resizing it)."""
        adapter = folder.adapter
        multiple = math.lcm(adapter.size_multiple(), adapter.vae_scale_factor())
        sized = (image.width // multiple * multiple, image.height // multiple * multiple)
        if sized == image.size:
            return image, []
        if not min(sized):
            raise HTTPException(422, f"{field} is {image.width}x{image.height}; {folder.class_name} needs at "
                                     f"least {multiple}x{multiple} (sides multiples of {multiple}).")
        from PIL import Image

        # With the resampling diffusers' image processor uses: a model whose VAE takes the original size resizes
        # it the same way, so the image equals memfit generate's from the resized file.
        resized = await asyncio.to_thread(image.resize, sized, Image.Resampling.LANCZOS)
        return resized, [f"{field} is {image.width}x{image.height}; memfit resized it to {sized[0]}x{sized[1]}, "
                         f"the nearest multiples of {multiple} below, as {folder.class_name} needs."]

    def _priced(entry: ModelEntry, folder: ModelFolder, runs: list[dict[str, Any]]):
        """The denoising seconds estimated for ``runs`` before they are queued (None: no size near theirs measured
        on ``entry`` yet; HTTP 422 over --max-seconds, naming the largest size and the most steps that fit), and the
        check of their own pace their job makes as it runs (memfit.serve.costs)."""
        first = runs[0]
        width, height = first["width"], first["height"]
        steps = int(first["steps"] * first["strength"]) if first.get("strength") is not None else first["steps"]
        multiple = folder.adapter.size_multiple()

        def check(measured: Measured) -> float:
            return check_seconds(measured, width, height, steps, len(runs), limits.max_seconds, multiple)

        nearest = step_times.nearest(entry.path, width, height)
        try:
            estimate = None if nearest is None else check(nearest)
        except MemfitError as exc:
            raise HTTPException(422, str(exc)) from exc
        return estimate, lambda seconds_per_step: check(Measured(width, height, seconds_per_step))

    def _find(requested, field: str) -> ModelEntry:
        """The listed checkpoint a request names; HTTP 422 naming those that can be served otherwise."""
        if not isinstance(requested, str):
            raise HTTPException(422, f"{field} must be a checkpoint's title (GET /sdapi/v1/sd-models), got {requested!r}.")
        try:
            return checkpoints.find(requested)
        except MemfitError as exc:
            raise HTTPException(422, f"{field}: {exc}") from exc

    def _vae(options: dict, field: str) -> str | None:
        """The sd_vae a request sets (None: it sets none); HTTP 422 for one this server does not list."""
        vae = options.get("sd_vae")
        if vae is not None:
            try:
                checkpoints.vae_file(vae)
            except MemfitError as exc:
                raise HTTPException(422, f"{field}: {exc}") from exc
        return vae

    def _module_files(options: dict, field: str) -> tuple[Path, ...] | None:
        """The module files a request's forge_additional_modules names (None: it names none); HTTP 422 for a value
        that is not a list of names or for a file not listed (GET /sdapi/v1/sd-modules)."""
        names = options.get("forge_additional_modules")
        if names is None:
            return None
        if not isinstance(names, list) or not all(isinstance(name, str) for name in names):
            raise HTTPException(422, f"{field} must be a list of module files' model_name or filename (GET "
                                     f"/sdapi/v1/sd-modules), got {names!r}.")
        try:
            return tuple(dict.fromkeys(checkpoints.module_file(name) for name in names))
        except MemfitError as exc:
            raise HTTPException(422, f"{field}: {exc}") from exc

    def _kept_modules(entry: ModelEntry) -> tuple[Path, ...]:
        """The module files chosen, while ``entry`` is the selected checkpoint; another checkpoint starts with its
        own files (the choice is for the checkpoint it was made on, whose slots it fits)."""
        return settings["forge_additional_modules"] if entry.path == checkpoints.selected.path else ()

    async def _modules(entry: ModelEntry, files: tuple[Path, ...], field: str) -> tuple[tuple[str, Path], ...]:
        try:
            return await asyncio.to_thread(checkpoints.modules_for, entry, files)
        except MemfitError as exc:
            raise HTTPException(422, f"{field}: {exc}") from exc

    async def _overridden(body: Txt2ImgRequest) -> tuple[ModelEntry, Path | None, tuple[tuple[str, Path], ...]]:
        """The checkpoint a request runs on, the VAE file it reads instead of the checkpoint's own (None: its
        own) and the module files it reads instead of its own ((component, file) pairs): its override_settings'
        sd_model_checkpoint, sd_vae and forge_additional_modules, else the selected ones. With
        override_settings_restore_afterwards false the overrides stay selected, as in A1111."""
        extra = body.model_extra or {}
        overrides = extra.get("override_settings") or {}
        if not isinstance(overrides, dict):
            raise HTTPException(422, f"override_settings must be an object of settings, got {overrides!r}.")
        vae = _vae(overrides, "override_settings.sd_vae")
        files = _module_files(overrides, "override_settings.forge_additional_modules")
        requested = overrides.get("sd_model_checkpoint")
        entry = checkpoints.selected if requested is None else _find(requested, "override_settings.sd_model_checkpoint")
        files = _kept_modules(entry) if files is None else files
        modules = await _modules(entry, files, "override_settings.forge_additional_modules")
        if extra.get("override_settings_restore_afterwards", True) is False:
            checkpoints.selected = entry
            settings["forge_additional_modules"] = files
            if vae is not None:
                settings["sd_vae"] = vae
        return entry, checkpoints.vae_file(vae or settings["sd_vae"]), modules

    async def _opened(entry: ModelEntry, vae: Path | None = None,
                      modules: tuple[tuple[str, Path], ...] = ()) -> ModelFolder:
        try:
            return await asyncio.to_thread(checkpoints.folder, entry, vae, modules)
        except MemfitError as exc:
            raise HTTPException(422, str(exc)) from exc

    def _runs(body: Txt2ImgRequest, folder: ModelFolder, conditioning: Conditioning | None = None,
              strength: float | None = None) -> tuple[list[dict[str, Any]], list[int], str | None]:
        """Session.generate arguments per image, the seeds, and the sampler on ``folder``'s model; HTTP 422
        for a request that cannot run, checked before it waits in the queue. ``conditioning`` (an init
        image and mask) and ``strength`` make it img2img or inpainting."""
        images = body.batch_size * body.n_iter
        if body.batch_size < 1 or body.n_iter < 1 or images > limits.max_images:
            raise HTTPException(422, f"batch_size x n_iter must be 1 to {limits.max_images} images, got "
                                     f"{body.batch_size} x {body.n_iter}; lower them (memfit serve --max-images raises it).")
        if body.seed < -1 or body.seed > MAX_SEED:
            raise HTTPException(422, f"seed must be -1 (random) or 0 to {MAX_SEED}, got {body.seed}.")
        sampler = _sampler(body, _own_scheduler(folder))
        prompt, loras = _prompt_loras(body.prompt)
        if not prompt.strip():  # memfit generate's own message names its --prompt flag
            raise HTTPException(422, 'The prompt is empty: send a description of the image in the JSON field "prompt", '
                                     'e.g. {"prompt": "a red circle"}.')
        if loras:
            conditioning = replace(conditioning or Conditioning(), loras=loras)
        try:
            if conditioning is not None:  # memfit's own refusal for a family without img2img, inpainting or LoRAs
                check_conditioning(folder.adapter, conditioning, False)
                if strength is not None and not folder.adapter.takes_strength(conditioning.task):
                    # A1111's clients send denoising_strength with every img2img request; an editing pipeline
                    # (FLUX.1 Kontext) draws beside its input instead of noising it, and takes none.
                    strength = None
            settings = folder.adapter.resolve(prompt, body.negative_prompt, body.steps, body.cfg_scale, 0,
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
        if folder.adapter.makes_video:  # A1111's API asks for images: a video model (Wan) draws a one-frame video
            for run in runs:
                run.update(frames=1)
        if conditioning is not None and conditioning.image is not None:
            # The size resolved from the image is what memfit generate --image resolves too.
            for run in runs:
                run.update(image=conditioning.image, mask=conditioning.mask_image, strength=settings.strength)
        if loras:
            for run in runs:
                run.update(loras=loras)
        return runs, seeds, sampler

    def _prompt_loras(prompt: str) -> tuple[str, tuple[tuple[str, float], ...]]:
        """The prompt without its <lora:NAME:WEIGHT> tags, and the (file, weight) of each, for this request only;
        HTTP 422 for a tag memfit cannot apply or a LoRA that is not listed."""
        try:
            prompt, tags = prompt_loras(prompt)
            return prompt, tuple((str(checkpoints.find_lora(tag.name).path), tag.weight) for tag in tags)
        except (ValueError, MemfitError) as exc:
            raise HTTPException(422, f"prompt: {exc}") from exc

    def _sampler(body: Txt2ImgRequest, own_scheduler: str) -> str | None:
        """memfit's name for the request's sampler and schedule type (None: the model's own scheduler)."""
        name = body.sampler_name or body.sampler_index
        if name in (None, "", "Default"):
            if body.scheduler not in (None, "", "automatic", "Automatic"):
                raise HTTPException(422, f"scheduler {body.scheduler!r} needs a sampler_name; name one (GET /sdapi/v1/samplers).")
            return None
        try:
            label = sampler_label(*split_sampler(name, body.scheduler, own_scheduler))
            resolve_sampler(label, own_scheduler)
        except MemfitError as exc:
            raise HTTPException(422, str(exc)) from exc
        return label

    return app


def _own_scheduler(folder: ModelFolder) -> str:
    """The class name of ``folder``'s own scheduler (what the samplers are built from)."""
    return folder.components.get("scheduler", ("", ""))[1]


async def _wait(job: Job, request: Request) -> bool:
    """Until ``job`` is finished; a client that goes away cancels it (a waiting job leaves the queue, a running one
    stops at its next cancellation point), so it never holds up the queue. Returns whether the client stayed."""
    queue: JobQueue = request.app.state.queue
    stayed = True
    while not job.done.is_set():
        if stayed and await request.is_disconnected():
            queue.cancel(job, "The client went away before this request ran.")
            stayed = False
        await asyncio.sleep(0.05)
    return stayed


def _request_line(route: str, body: Txt2ImgRequest, job: Job | None, status: int, seconds: float, detail: str) -> str:
    """The log line of one generation request: its job, size, steps and images, then how it ended, how long it
    took (queued time included) and the peak memory of its runs; ``detail``: what went wrong, if anything."""
    if job is None:  # refused before it was queued
        size = f"{body.width or 'default'}x{body.height or 'default'}"
        what = f"{route} {body.force_task_id or '-'}: {size}, {body.steps or 'default'} steps"
        return f"{what}: {status} refused in {seconds:.2f} s: {detail}"
    first = job.runs[0]
    peak = max((report.get("peak_bytes", 0) for report in job.reports), default=0)
    line = (f"{route} {job.id}: {first['width']}x{first['height']}, {first['steps']} steps, {len(job.runs)} image(s): "
            f"{status} {job.state} in {seconds:.2f} s, peak {format_bytes(peak) if peak else '-'}")
    return f"{line}: {detail}" if detail else line


def _host_memory() -> dict:
    """A1111's "ram" entry from what memfit plans with: ``used`` is this process's resident memory,
    ``free`` what it could still allocate (the container's limit counted), ``total`` the most it could have."""
    import psutil

    from memfit.plan.budget import read_host_memory

    try:
        host = read_host_memory()
        used = psutil.Process().memory_info().rss
    except (OSError, MemfitError) as exc:
        return {"error": str(exc)}
    return {"free": host.available, "used": used, "total": host.total or host.available + used}


def _device_memory(device) -> dict:
    """A1111's "cuda" entry for the server's device: its memory and what the process's allocator holds,
    or an "error" entry where the server does not run on a GPU, as A1111 gives without one."""
    from memfit.devices import runtime_for

    if device.type != "cuda":
        return {"error": f"unavailable: this server runs on {device}"}
    try:
        runtime = runtime_for(device)
        free, total = runtime.mem_get_info()
        return {"system": {"free": free, "used": total - free, "total": total},
                "allocated": {"current": runtime.memory_allocated(), "peak": runtime.max_memory_allocated()},
                "reserved": {"current": runtime.memory_reserved(), "peak": runtime.max_memory_reserved()},
                "events": {"retries": runtime.alloc_retries()}}
    except (RuntimeError, MemfitError) as exc:
        return {"error": str(exc)}


async def _json_object(request: Request) -> dict:
    try:
        value = json.loads(await request.body() or b"{}")
    except (json.JSONDecodeError, UnicodeDecodeError, binascii.Error) as exc:
        raise HTTPException(422, f"The body is not JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise HTTPException(422, "The body must be a JSON object.")
    return value


def _decode_image(data: str, field: str, mode: str | None, max_pixels: int):
    """A PIL image from a base64 string (A1111's optional "data:image/png;base64," prefix allowed),
    opened as memfit generate opens an image file (``mode`` "RGB" for the init image, as is for a mask);
    HTTP 422 saying what is wrong otherwise, and for an image whose header gives it more than
    ``max_pixels`` pixels or more than Pillow's decompression-bomb limit, before any of it is decoded."""
    from PIL import Image

    if data.startswith("data:"):
        data = data.partition(",")[2]
    try:
        raw = base64.b64decode("".join(data.split()), validate=True)
    except (binascii.Error, ValueError) as exc:
        raise HTTPException(422, f"{field} is not valid base64 ({exc}); send the image file's bytes base64-encoded, "
                                 "e.g. a PNG.") from None
    try:
        with Image.open(io.BytesIO(raw)) as opened:  # reads the header only
            width, height = opened.size
            if width * height > max_pixels:
                raise HTTPException(422, f"{field} is {width}x{height}, {width * height} pixels, more than the "
                                         f"{max_pixels} a request may send; send a smaller image (memfit serve "
                                         "--max-pixels raises the limit).")
            if Image.MAX_IMAGE_PIXELS and width * height > Image.MAX_IMAGE_PIXELS:
                raise HTTPException(422, f"{field} is {width}x{height}, {width * height} pixels, more than Pillow "
                                         f"decodes safely ({Image.MAX_IMAGE_PIXELS}, its decompression-bomb limit); "
                                         "send a smaller image.")
            return opened.convert(mode) if mode else opened.copy()
    except (OSError, ValueError, Image.DecompressionBombError) as exc:
        raise HTTPException(422, f"{field} is not an image Pillow can read ({exc}); send a PNG or JPEG, "
                                 "base64-encoded.") from None


def _ignored(body: Txt2ImgRequest, conditioning: Conditioning | None, sampler: str | None) -> list[str]:
    """The fields of ``body`` memfit did not act on whose value would have changed A1111's image
    (``sampler``: the A1111 sampler it ran with, schedule type left out; None: the model's own)."""
    extra = dict(body.model_extra or {})
    masked = conditioning is not None and conditioning.mask_image is not None
    img2img = isinstance(body, Img2ImgRequest)
    ignored = []
    for name, value in extra.items():
        if name in HIRES_ONLY and not extra.get("enable_hr") or name in MASK_ONLY and img2img and not masked:
            continue
        if name == "eta":
            harmless = (None, ETA_DEFAULT.get(sampler, 1)) if sampler else (None,)
        elif name in IMG2IMG_HARMLESS:  # on txt2img an img2img field is never harmless: it asks for what is not there
            harmless = (None, *IMG2IMG_HARMLESS[name]) if img2img else ()
        else:
            harmless = HARMLESS.get(name, ())
        if name == "override_settings" and isinstance(value, dict):
            ignored += [f"override_settings.{key}" for key in value if key not in SETTINGS_ACTED_ON]
        elif value not in harmless:
            ignored.append(name)
    if body.save_images:
        ignored.append("save_images")  # the server writes no files; the client gets the images
    return sorted(ignored)
