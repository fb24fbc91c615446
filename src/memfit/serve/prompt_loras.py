"""AUTOMATIC1111's LoRA tags in a prompt: ``<lora:NAME>`` and ``<lora:NAME:WEIGHT>``.

A1111 (its extra networks) finds every ``<type:arguments>`` tag in the prompt, removes it, and applies
the network for that request: ``<lora:style:0.8>`` is the LoRA named "style" at weight 0.8 (1 when left
out), ``lyco`` the same; the arguments are ":"-separated, positional or ``key=value``. A1111's own
further forms give the text encoder and the denoiser weights of their own (``<lora:style:0.8:0.5>``,
``te=``, ``unet=``): memfit applies one weight to both, so it takes them only when they agree. Only
the tag is removed, the text around it stays as written: "a cat, <lora:style:0.8>" is the prompt
"a cat, " with that LoRA, as in A1111.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

__all__ = ["LoraTag", "prompt_loras"]

# A1111's pattern for an extra network tag (modules/extra_networks.py there).
EXTRA_NETWORK = re.compile(r"<(\w+):([^>]+)>")
LORA_TYPES = ("lora", "lyco")


@dataclass(frozen=True)
class LoraTag:
    name: str
    weight: float


def prompt_loras(prompt: str) -> tuple[str, list[LoraTag]]:
    """``prompt`` without its LoRA tags, and the tags in order; ValueError saying what is wrong with a tag
    memfit cannot apply (another network type, a weight that is not a number, two different weights)."""
    tags: list[LoraTag] = []

    def take(match: re.Match) -> str:
        tag = match.group(0)
        if match.group(1) not in LORA_TYPES:
            raise ValueError(f"{tag}: memfit applies only LoRA tags (<lora:NAME:WEIGHT>), not "
                             f"{match.group(1)!r} networks; remove the tag.")
        arguments = match.group(2).split(":")
        positional = [argument for argument in arguments if "=" not in argument]
        named = dict(argument.split("=", 1) for argument in arguments if "=" in argument)
        unknown = sorted(set(named) - {"te", "unet"})
        if unknown or len(positional) > 3 or not positional[:1] or not positional[0].strip():
            raise ValueError(f"{tag} is not a LoRA tag memfit reads; write <lora:NAME> or <lora:NAME:WEIGHT>.")
        text_encoder = named.get("te", positional[1] if len(positional) > 1 else "1")
        denoiser = named.get("unet", positional[2] if len(positional) > 2 else text_encoder)
        weights = {_weight(value, tag) for value in (text_encoder, denoiser)}
        if len(weights) > 1:
            raise ValueError(f"{tag} gives the text encoder and the denoiser different weights; memfit applies one "
                             "weight to both: write <lora:NAME:WEIGHT>.")
        tags.append(LoraTag(positional[0].strip(), weights.pop()))
        return ""

    return EXTRA_NETWORK.sub(take, prompt), tags


def _weight(text: str, tag: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{tag}: the weight {text!r} is not a number; write <lora:NAME:WEIGHT>, e.g. "
                         "<lora:NAME:0.8>.") from None
    if not math.isfinite(value):
        raise ValueError(f"{tag}: the weight must be a finite number, not {text!r}.")
    return value
