"""A batch's jobs: one JSON object per line of a JSONL file, checked up front, each line's faults named.

A job is ``{"id": ..., "prompt": ..., "negative_prompt": ..., "seed": ..., "steps": ..., "guidance": ...,
"width": ..., "height": ..., "loras": [...]}``; every field but ``id`` and ``prompt`` defaults to the
command's flag. ``loras`` lists LoRA files as "PATH[:SCALE]" strings or [PATH, SCALE] pairs, as --lora.
A line that is not such an object is a BadLine with its line number, never half-run. A job's
``key`` is a hash of everything that decides its image (its fields after defaults with each LoRA
by its content, the model's content fingerprint and the dtype): resuming a batch skips a job only
when both its id and its key match, so a model or LoRA changed in place runs its jobs again.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from memfit.cache.fingerprint import fingerprint_path
from memfit.errors import MemfitError

__all__ = ["BadLine", "Job", "JobDefaults", "read_jobs"]

FIELDS = ("id", "prompt", "negative_prompt", "seed", "steps", "guidance", "width", "height", "loras")
# An id names its output file: <out>/<id>.png, so it must be a plain, portable file name.
ID_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


@dataclass(frozen=True)
class JobDefaults:
    """The settings a job may give; as the command's flags, what a job's missing fields take
    (None: the model's or pipeline's default)."""

    negative_prompt: str | None = None
    seed: int = 0
    steps: int | None = None
    guidance: float | None = None
    width: int | None = None
    height: int | None = None
    loras: tuple[tuple[str, float], ...] = ()  # (file, scale) pairs

    def arguments(self) -> dict:
        """Keyword arguments of memfit.generate that make these settings' image."""
        return {f.name: getattr(self, f.name) for f in fields(JobDefaults)}


@dataclass(frozen=True, kw_only=True)
class Job(JobDefaults):
    id: str
    prompt: str
    line: int
    key: str = field(default="", compare=False)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "Job":
        return cls(**data)


@dataclass(frozen=True)
class BadLine:
    line: int
    message: str

    def __str__(self) -> str:
        return f"line {self.line}: {self.message}"


def job_key(settings: dict, model: str, dtype: str, content_of) -> str:
    """``model``: the model's content fingerprint (ModelFolder.fingerprint); ``content_of(path)``: a LoRA's."""
    # A job without LoRAs has no "loras" part: for one model, the key it had before jobs could name any.
    content = {name: settings[name] for name in FIELDS if name != "id" and (name != "loras" or settings[name])}
    if settings["loras"]:
        content["loras"] = [[content_of(lora), scale] for lora, scale in settings["loras"]]
    content.update(model=model, dtype=dtype)
    return hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()[:32]


def read_jobs(path: str | Path, defaults: JobDefaults, *, model: str | Callable[[], str],
              dtype: str) -> tuple[list[Job], list[BadLine]]:
    """The jobs of a JSONL file and its bad lines (blank lines are allowed and skipped); ``model``: the
    model's content fingerprint, for the jobs' keys, or what computes it (only once the file is read: a
    first fingerprint reads every byte of the model, too long to wait for before saying the file is missing)."""
    path = Path(path)
    if path.is_dir():
        raise MemfitError(f"Jobs file {path} is a folder; pass a JSONL file with one job object per line.")
    if not path.is_file():
        raise MemfitError(f"Jobs file {path} does not exist; pass a JSONL file with one job object per line.")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise MemfitError(f"{path} is not UTF-8 text ({exc.reason} at byte {exc.start}); save it as UTF-8.") from None
    jobs: list[Job] = []
    bad: list[BadLine] = []
    seen: dict[str, int] = {}
    content_of = functools.cache(fingerprint_path)  # each LoRA file read once, however many jobs name it
    model_print = functools.cache(model if callable(model) else lambda: model)
    for number, raw in enumerate(text.splitlines(), start=1):
        if not raw.strip():
            continue
        try:
            found = _parse(raw, defaults)
            job = Job(**found, line=number, key=job_key(found, model_print(), dtype, content_of))
        except ValueError as exc:
            bad.append(BadLine(number, str(exc)))
            continue
        if job.id in seen:
            bad.append(BadLine(number, f"id {job.id!r} was already used on line {seen[job.id]}; give every job its own id"))
            continue
        seen[job.id] = number
        jobs.append(job)
    return jobs, bad


def _parse(raw: str, defaults: JobDefaults) -> dict:
    """A job line's fields after defaults; ValueError saying what is wrong with it."""
    try:
        data = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not valid JSON ({exc.msg} at column {exc.colno})") from None
    if not isinstance(data, dict):
        raise ValueError(f"a job is a JSON object like {{\"id\": \"cat-1\", \"prompt\": \"a cat\"}}, not {type(data).__name__}")
    unknown = sorted(set(data) - set(FIELDS))
    if unknown:
        raise ValueError(f"unknown field(s) {', '.join(map(repr, unknown))}; a job may have {', '.join(FIELDS)}")
    if "id" not in data:
        raise ValueError('no "id"; every job needs an id, which names its output <id>.png')
    job_id = data["id"]
    if isinstance(job_id, int) and not isinstance(job_id, bool):
        job_id = str(job_id)
    if not isinstance(job_id, str) or not ID_PATTERN.fullmatch(job_id):
        raise ValueError(f"id {data['id']!r} cannot name a file; use letters, digits, '.', '_' and '-' "
                         "(up to 128, not starting with '.' or '-')")
    prompt = data.get("prompt")
    if not isinstance(prompt, str) or not prompt.strip():
        raise ValueError(f'job {job_id!r} has no prompt; "prompt" must be a non-empty string')
    found = {"id": job_id, "prompt": prompt}
    negative = data.get("negative_prompt", defaults.negative_prompt)
    if negative is not None and not isinstance(negative, str):
        raise ValueError(f'job {job_id!r}: "negative_prompt" must be a string or null')
    found["negative_prompt"] = negative
    for name, low in (("seed", 0), ("steps", 1), ("width", 1), ("height", 1)):
        value = data.get(name, getattr(defaults, name))
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < low):
            raise ValueError(f'job {job_id!r}: "{name}" must be an integer of at least {low}, not {value!r}')
        found[name] = value
    guidance = data.get("guidance", defaults.guidance)
    if guidance is not None and (not isinstance(guidance, (int, float)) or isinstance(guidance, bool)
                                 or not math.isfinite(guidance) or guidance < 0):
        raise ValueError(f'job {job_id!r}: "guidance" must be a number of at least 0, not {guidance!r}')
    found["guidance"] = None if guidance is None else float(guidance)
    found["loras"] = _loras(data.get("loras", defaults.loras), job_id)
    return found


def _loras(value, job_id: str) -> tuple[tuple[str, float], ...]:
    """A job's "loras" as (file, scale) pairs, each file existing; ValueError saying what is wrong otherwise."""
    from memfit.models.lora import parse_lora

    wanted = f'job {job_id!r}: "loras" must be a list of "PATH[:SCALE]" strings or [PATH, SCALE] pairs'
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"{wanted}, not {value!r}")
    loras = []
    for item in value:
        if isinstance(item, str):
            path, scale = parse_lora(item)
        elif (isinstance(item, (list, tuple)) and len(item) == 2 and isinstance(item[0], str)
              and isinstance(item[1], (int, float)) and not isinstance(item[1], bool)):
            path, scale = item[0], float(item[1])
        else:
            raise ValueError(f"{wanted}, not {item!r}")
        if not math.isfinite(scale):
            raise ValueError(f"job {job_id!r}: the scale of LoRA {path} must be a finite number, not {scale!r}")
        if not Path(path).expanduser().exists():
            raise ValueError(f"job {job_id!r}: LoRA file {path} does not exist")
        loras.append((str(Path(path).expanduser().resolve()), scale))  # a Ray worker has another current folder
    return tuple(loras)
