"""Prompt embeddings in memfit's content-addressed store: a repeated prompt never loads a text encoder.

The key is content only: the text encoders' and tokenizers' fingerprint (memfit.run.generate.
text_fingerprint), the pipeline class, the prompt, the negative prompt, whether the negative branch
was encoded, the run dtype, the input image's content where the text encoders see it (Qwen-Image-Edit:
PipelineAdapter.prompt_sees_image), and the backend the text encoders ran with (a compiled encoder's
embeddings differ from eager ones within its tolerance, and a hit must give exactly what a miss
would have). The entry is an Embeddings safetensors file, so a hit is bitwise the tensors the
miss produced. MEMFIT_CACHE=0 turns it off; MEMFIT_CACHE=require makes a miss an error.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any, Mapping

import torch

from memfit.cache import CacheKey, open_store
from memfit.cache.settings import CacheMode
from memfit.run.embeddings import Embeddings

KIND = "embeddings"
FILE_NAME = "embeddings.safetensors"


def text_backend_label(backend: Any, text_encoders) -> dict[str, str]:
    """Which backend each text encoder runs with ("eager" when not compiled)."""
    from memfit.compile.backends import Backend

    def name_of(spec: Any) -> str:
        return spec.label if isinstance(spec, Backend) else str(spec)

    labels = {}
    for encoder in text_encoders:
        if not encoder.startswith("text_encoder"):
            continue
        if backend is None:
            spec = "eager"
        elif isinstance(backend, Mapping):
            spec = backend.get(encoder, backend.get("*", "eager"))
        else:
            spec = backend
        labels[encoder] = name_of(spec)
    return labels


def image_fingerprint(image) -> str:
    """A digest of a PIL image's content (mode, size, pixels): what embeddings encoded with it depend on. Of
    several images (a list), a digest of each one's, in their order."""
    if isinstance(image, (list, tuple)):
        return hashlib.sha256(f"memfit-images/1:{len(image)}:{':'.join(map(image_fingerprint, image))}".encode()
                              ).hexdigest()
    digest = hashlib.sha256(f"memfit-image/1:{image.mode}:{image.size[0]}x{image.size[1]}:".encode())
    digest.update(image.tobytes())
    return digest.hexdigest()


def embeddings_key(text_fingerprint: str, pipeline_class: str, prompt: str, negative_prompt: str | None,
                   with_negative: bool, dtype: torch.dtype, backends: Mapping[str, str],
                   image: str | None = None) -> CacheKey:
    """``image``: the image_fingerprint of the input image the text encoders see, None where they see none
    (then the key is what it was before images entered it, so earlier entries still hit)."""
    fields = {
        "text_fingerprint": text_fingerprint,
        "pipeline_class": pipeline_class,
        "prompt": prompt,
        "negative_prompt": negative_prompt,
        "with_negative": bool(with_negative),
        "dtype": str(dtype),
        # Sorted by encoder role so the key holds no part-name-dependent ordering.
        "text_backends": sorted(backends.values()),
    }
    if image is not None:
        fields["image"] = image
    return CacheKey(KIND, fields)


class PromptCache:
    """Look up and store one encode stage's embeddings (built per call from the environment)."""

    def __init__(self, key: CacheKey, store=None):
        self.key = key
        self.store = store if store is not None else open_store()

    @property
    def enabled(self) -> bool:
        return self.store.mode is not CacheMode.OFF

    def lookup(self) -> dict[str, torch.Tensor] | None:
        """The cached tensors (on CPU) or None. Raises under MEMFIT_CACHE=require on a miss."""
        found = self.store.get(self.key)
        if found is None:
            return None
        return Embeddings.load(Path(found) / FILE_NAME).tensors

    def save(self, tensors: Mapping[str, torch.Tensor], pipeline_class: str, text_fingerprint: str,
             prompt: str, negative_prompt: str | None) -> None:
        """Store the embeddings. A store that cannot take them (a full disk) leaves the run uncached with one
        warning (memfit.cache.store): the bytes are made here and written by the store, which owns its faults."""
        if not self.enabled:
            return
        embeddings = Embeddings(dict(tensors), pipeline_class, text_fingerprint, prompt, negative_prompt)
        self.store.put(self.key, {FILE_NAME: embeddings.to_bytes()}, meta={"prompt": prompt[:80]})
