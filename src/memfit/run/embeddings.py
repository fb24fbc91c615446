"""Prompt embeddings as a file: the encode stage's output, reusable without the text encoders.

Format: a safetensors file whose tensors are named by the pipeline's own keyword arguments
(prompt_embeds, negative_prompt_embeds, pooled_prompt_embeds, ...) and whose metadata records
the format version, pipeline class, a fingerprint of the text encoders and tokenizers, the prompts
and the shapes. A file is only used with a model whose text encoders have the same fingerprint.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from memfit.atomic import write_atomically
from memfit.errors import MemfitError
from memfit.models.folder import check_safetensors
from memfit.version import __version__

FORMAT = "memfit-embeddings/1"


@dataclass
class Embeddings:
    tensors: dict[str, torch.Tensor]
    pipeline_class: str
    text_fingerprint: str
    prompt: str
    negative_prompt: str | None
    extra: dict[str, str] = field(default_factory=dict)

    @property
    def has_negative(self) -> bool:
        return any(name.startswith("negative_") for name in self.tensors)

    def metadata(self) -> dict[str, str]:
        return {
            "format": FORMAT,
            "memfit_version": __version__,
            "pipeline_class": self.pipeline_class,
            "text_fingerprint": self.text_fingerprint,
            "prompt": self.prompt,
            "negative_prompt": json.dumps(self.negative_prompt),
            "shapes": json.dumps({name: list(t.shape) for name, t in self.tensors.items()}),
            **self.extra,
        }

    def to_bytes(self) -> bytes:
        """The file's bytes."""
        from safetensors.torch import save

        tensors = {name: t.detach().contiguous().cpu() for name, t in self.tensors.items()}
        return save(tensors, metadata=self.metadata())

    def save(self, path: str | Path) -> Path:
        """Write atomically: a crash leaves either the old file or none, never a partial one. Written by Python,
        so a failed write (a full disk) is an OSError, which write_atomically names."""
        return write_atomically(path, lambda tmp: Path(tmp).write_bytes(self.to_bytes()))

    @classmethod
    def load(cls, path: str | Path) -> "Embeddings":
        from safetensors import safe_open

        path = Path(path)
        if not path.is_file():
            raise MemfitError(f"Embeddings file {path} does not exist; create it with memfit encode --out {path}.")
        check_safetensors(path)
        try:
            with safe_open(str(path), framework="pt") as handle:
                metadata = handle.metadata() or {}
                tensors = {name: handle.get_tensor(name) for name in handle.keys()}
        except Exception as exc:
            raise MemfitError(f"{path} is not a readable embeddings file ({exc}); re-create it with memfit encode.") from None
        if metadata.get("format") != FORMAT:
            raise MemfitError(f"{path} is not a memfit embeddings file (format {metadata.get('format')!r}); create it with memfit encode.")
        known = {"format", "memfit_version", "pipeline_class", "text_fingerprint", "prompt", "negative_prompt", "shapes"}
        return cls(
            tensors=tensors,
            pipeline_class=metadata["pipeline_class"],
            text_fingerprint=metadata["text_fingerprint"],
            prompt=metadata["prompt"],
            negative_prompt=json.loads(metadata["negative_prompt"]),
            extra={k: v for k, v in metadata.items() if k not in known},
        )
