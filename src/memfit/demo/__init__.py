"""memfit's built-in demo model: a tiny Stable Diffusion pipeline trained on coloured shapes.

It ships inside the package (``memfit/demo/model/``, standard diffusers layout, safetensors), so a
new user with no internet can run ``memfit generate --prompt "a red circle on a blue background"``.
``scripts/train_demo_model.py`` trains it; ``scripts/eval_demo_model.py`` measures it.
"""

from __future__ import annotations

import json
import pathlib

from memfit.errors import MemfitError

__all__ = ["model_dir", "defaults"]

_MODEL_DIR = pathlib.Path(__file__).resolve().parent / "model"
_REQUIRED = (
    "model_index.json",
    "unet/diffusion_pytorch_model.safetensors",
    "vae/diffusion_pytorch_model.safetensors",
    "text_encoder/model.safetensors",
    "tokenizer/tokenizer_config.json",
    "scheduler/scheduler_config.json",
)


def model_dir() -> pathlib.Path:
    """The shipped demo model folder; raises MemfitError if its weights are missing."""
    missing = [name for name in _REQUIRED if not (_MODEL_DIR / name).is_file()]
    if missing:
        raise MemfitError(
            f"The built-in demo model in {_MODEL_DIR} is incomplete (missing {', '.join(missing)}); "
            "reinstall memfit, or retrain it from a source checkout with "
            "`python scripts/train_demo_model.py` (about 30 minutes on 2 CPU cores)."
        )
    return _MODEL_DIR


def defaults() -> dict:
    """Recommended generation settings for the demo model: steps, guidance, width, height."""
    path = model_dir() / "memfit_defaults.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise MemfitError(
            f"Could not read the demo model's settings {path} ({error}); "
            "retrain it with `python scripts/train_demo_model.py`."
        ) from error
