"""A model folder's pipeline as plain diffusers loads it: what the parity oracle and the test LoRAs start from."""

from __future__ import annotations

from pathlib import Path


def plain_pipeline(model_dir: str | Path, components: dict | None = None, **options):
    """The folder's pipeline as plain diffusers loads it: from_pretrained with ``options``, and ``components``
    (name -> model) in place of the folder's, with what memfit loads itself where diffusers cannot here (a
    Qwen2VLProcessor without torchvision: PipelineAdapter.load_apart) passed the same way: the object a plain
    diffusers user would build and pass."""
    import diffusers

    from memfit.models.folder import ModelFolder

    folder = ModelFolder.open(model_dir)
    components = {**folder.adapter.load_apart(folder.config_folder, list(folder.components)), **(components or {})}
    pipeline_class = diffusers.DiffusionPipeline
    if components:  # DiffusionPipeline.from_pretrained loads the folder's own in place of models passed to it
        pipeline_class = getattr(diffusers, diffusers.DiffusionPipeline.load_config(model_dir)["_class_name"])
    return pipeline_class.from_pretrained(model_dir, **options, **components)
