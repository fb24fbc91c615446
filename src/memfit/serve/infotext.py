"""AUTOMATIC1111's "infotext": the parameters text it writes into its PNGs ("parameters") and gives
in its answers (info.infotexts), written for memfit's runs and read back for /sdapi/v1/png-info.

    a red circle                          the prompt (any number of lines)
    Negative prompt: blurry               the negative prompt (any number of lines)
    Steps: 2, Sampler: Euler a, CFG scale: 3.5, Seed: 7, Size: 32x32, Model: sd

The last line is "key: value" pairs; a value with a comma, colon or line break is JSON-quoted.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

__all__ = ["image_text", "infotext", "parse_infotext", "read_parameters"]

# One "key: value" pair of the last line; the value runs to the next comma unless it is quoted.
_PAIR = re.compile(r'\s*(\w[\w \-/]*):\s*("(?:[^"\\]|\\.)*"|[^,]*)(?:,|$)')
_SIZE = re.compile(r"^(\d+)x(\d+)$")
# What Pillow puts in Image.info that is about the file's encoding, not how the image was made.
_FILE_KEYS = {"jfif", "jfif_version", "jfif_unit", "jfif_density", "dpi", "exif", "loop", "background", "timestamp",
              "duration", "progressive", "progression", "icc_profile", "chromaticity", "photoshop"}
# memfit's own PNG text chunks (memfit.run.stages.png_metadata) an infotext is made from.
_MEMFIT_KEYS = {"prompt", "seed", "steps", "guidance", "width", "height"}


def _quoted(value) -> str:
    text = str(value)
    return json.dumps(text, ensure_ascii=False) if any(c in text for c in ",:\n") else text


def infotext(prompt: str, negative: str | None, run: dict, sampler: str | None, model: str) -> str:
    """The infotext of one run (``run``: steps, guidance, seed, width, height, and strength when it
    started from an image)."""
    lines = [prompt]
    if negative:
        lines.append(f"Negative prompt: {negative}")
    lines.append(f"Steps: {run['steps']}, Sampler: {sampler or 'Default'}, CFG scale: {run['guidance']}, "
                 f"Seed: {run['seed']}, Size: {run['width']}x{run['height']}, Model: {_quoted(model)}"
                 + (f", Denoising strength: {run['strength']}" if run.get("strength") is not None else ""))
    return "\n".join(lines)


def parse_infotext(text: str) -> dict[str, str]:
    """The fields of an infotext as A1111's png-info gives them: "Prompt", "Negative prompt", and one
    entry per pair of the last line, a size "WxH" split into "<key>-1" and "<key>-2"."""
    lines = text.strip().split("\n")
    pairs = _PAIR.findall(lines[-1])
    if len(pairs) < 3:  # a prompt line that happens to hold a colon is not the parameters line
        pairs = []
    else:
        lines = lines[:-1]
    prompt, negative, in_negative = [], [], False
    for line in lines:
        line = line.strip()
        if line.startswith("Negative prompt:"):
            in_negative, line = True, line[len("Negative prompt:"):].strip()
        (negative if in_negative else prompt).append(line)
    fields = {"Prompt": "\n".join(prompt), "Negative prompt": "\n".join(negative)}
    for key, value in pairs:
        if len(value) > 1 and value[0] == value[-1] == '"':
            try:
                value = json.loads(value)
            except json.JSONDecodeError:
                pass  # kept as written, quotes and all: a value is never dropped
        size = _SIZE.match(value)
        if size:
            fields[f"{key}-1"], fields[f"{key}-2"] = size.groups()
        else:
            fields[key] = value
    return fields


def image_text(image) -> dict:
    """What a PIL image's own items say about how it was made (its PNG text chunks), without those
    about the file's encoding."""
    return {key: value for key, value in image.info.items()
            if key not in _FILE_KEYS and isinstance(value, (str, int, float))}


def read_parameters(image) -> tuple[str, dict, dict]:
    """(infotext, other items, parsed fields) of a PIL image, as A1111's /sdapi/v1/png-info answers:
    A1111's "parameters" text chunk, or an infotext made from memfit's own chunks; ("", items, {})
    for an image with neither."""
    items = image_text(image)
    text = items.pop("parameters", None)
    if text is None and _MEMFIT_KEYS <= items.keys():
        model = items.get("model", "")
        text = infotext(items["prompt"], items.get("negative_prompt"), items, items.get("sampler"),
                        Path(model).name or model)
    return (text, items, parse_infotext(text)) if text else ("", items, {})
