"""Qwen-Image-Edit's text encoder sees the input image: the encode stage takes --image, embeddings (a file, the
prompt cache) depend on its content, and a run without the image is refused. Parity with plain diffusers is
tests/test_families.py's (rows qwenimage_edit, qwenimage_edit_plus)."""

from __future__ import annotations

import base64
import io

import pytest
import torch

import memfit
from memfit.errors import MemfitError
from memfit.run.embeddings import Embeddings
from memfit.testing import conditioning

PROMPT = "a red house near the sea"
NEGATIVE = "blurry"
IMAGE = conditioning.test_image(64, seed=1)
OTHER_IMAGE = conditioning.test_image(64, seed=2)
RUN = dict(steps=1, guidance=4.0, seed=3, progress=False)


@pytest.fixture
def cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("MEMFIT_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _equal(a: Embeddings, b: Embeddings) -> bool:
    return a.tensors.keys() == b.tensors.keys() and all(torch.equal(a.tensors[n], b.tensors[n]) for n in a.tensors)


def test_encode_with_image_then_embeddings_file_is_bitwise_the_direct_run(tiny_models, cache_dir, tmp_path):
    from memfit.cli.app import main

    model = tiny_models("qwenimage_edit")
    image_file, out = tmp_path / "input.png", tmp_path / "edit.safetensors"
    IMAGE.save(image_file)
    assert main(["encode", "--model", model, "--prompt", PROMPT, "--negative-prompt", NEGATIVE,
                 "--image", str(image_file), "--out", str(out), "--quiet"]) == 0
    direct = memfit.generate(PROMPT, model=model, negative_prompt=NEGATIVE, image=IMAGE, **RUN)
    from_file = memfit.generate(model=model, embeddings=out, image=image_file, **RUN)
    assert "encode stage skipped: embeddings loaded from file" in from_file.report.notes
    assert from_file.images[0].tobytes() == direct.images[0].tobytes()
    # The file's embeddings are the encode stage's of a run with this image, not of the prompt alone.
    encoded, _ = memfit.encode(PROMPT, model=model, negative_prompt=NEGATIVE, image=IMAGE)
    assert _equal(Embeddings.load(out), encoded)


def test_another_image_gives_other_embeddings_and_never_a_stale_cache_hit(tiny_models, cache_dir, monkeypatch):
    model = tiny_models("qwenimage_edit")
    first, _ = memfit.encode(PROMPT, model=model, image=IMAGE)
    other, other_report = memfit.encode(PROMPT, model=model, image=OTHER_IMAGE)
    assert other_report.stages[0].note != "cache hit"
    assert not _equal(first, other)
    again, again_report = memfit.encode(PROMPT, model=model, image=IMAGE)  # the cache does serve a repeat
    assert again_report.stages[0].note == "cache hit" and _equal(again, first)
    monkeypatch.setenv("MEMFIT_CACHE", "0")
    uncached, _ = memfit.encode(PROMPT, model=model, image=OTHER_IMAGE)
    assert _equal(uncached, other)


def test_plus_embeddings_depend_on_the_image_too(tiny_models, cache_dir):
    model = tiny_models("qwenimage_edit_plus")
    first, _ = memfit.encode(PROMPT, model=model, image=IMAGE)
    other, _ = memfit.encode(PROMPT, model=model, image=OTHER_IMAGE)
    assert not _equal(first, other)


def test_runs_without_the_image_or_with_another_one_are_refused(tiny_models, cache_dir):
    model = tiny_models("qwenimage_edit")
    with pytest.raises(MemfitError, match="edits an image: pass --image IMG"):
        memfit.generate(PROMPT, model=model, **RUN)
    with pytest.raises(MemfitError, match="encodes the prompt together with the image it edits: pass --image"):
        memfit.encode(PROMPT, model=model)
    with pytest.raises(MemfitError, match="do not see the input image"):
        memfit.encode(PROMPT, model=tiny_models("qwenimage"), image=IMAGE)
    embeddings, _ = memfit.encode(PROMPT, model=model, negative_prompt=NEGATIVE, image=IMAGE)
    with pytest.raises(MemfitError, match="encoded with another input image than this --image"):
        memfit.generate(model=model, embeddings=embeddings, image=OTHER_IMAGE, **RUN)


def test_prompt_cache_key_holds_the_image_only_where_given():
    from memfit.run.prompt_cache import embeddings_key, image_fingerprint

    def key(image):
        return embeddings_key("fp", "QwenImageEditPipeline", PROMPT, None, False, torch.float32, {}, image=image).digest

    assert image_fingerprint(IMAGE) == image_fingerprint(IMAGE.copy())
    assert len({key(None), key(image_fingerprint(IMAGE)), key(image_fingerprint(OTHER_IMAGE))}) == 3
    assert "image" not in embeddings_key("fp", "QwenImagePipeline", PROMPT, None, False, torch.float32, {}).parts


def test_serve_img2img_edits_as_memfit_generate_does(tiny_models, cache_dir):
    """memfit serve's img2img endpoint reaches the edit pipeline with its init image (A1111's denoising_strength,
    which an editing pipeline takes none of, is left out), and its text encoder sees the image."""
    from fastapi.testclient import TestClient

    from memfit.run.media import png_bytes
    from memfit.run.session import Session
    from memfit.serve import create_app

    model = tiny_models("qwenimage_edit")
    expected = memfit.generate(PROMPT, model=model, image=IMAGE, steps=1, seed=4, guidance=1.0, progress=False)
    buffer = io.BytesIO()
    IMAGE.save(buffer, format="PNG")
    with TestClient(create_app(Session(model))) as client:
        response = client.post("/sdapi/v1/img2img", json={
            "prompt": PROMPT, "steps": 1, "seed": 4, "cfg_scale": 1.0, "denoising_strength": 0.75,
            "init_images": [base64.b64encode(buffer.getvalue()).decode()]})
        assert response.status_code == 200, response.text
        assert base64.b64decode(response.json()["images"][0]) == png_bytes(expected.images[0], expected.metadata)
        refused = client.post("/sdapi/v1/txt2img", json={"prompt": PROMPT, "steps": 1})
        assert refused.status_code == 422 and "--image" in refused.text


@pytest.mark.parametrize("kind", ["qwenimage_edit", "qwenimage_edit_plus"])
def test_a_lora_equals_diffusers(tiny_models, cache_dir, tmp_path, kind):
    """A PEFT LoRA goes into the transformer, as diffusers' QwenImage loader puts it; the oracle can fail."""
    from memfit.models.lora import check_loras
    from memfit.testing import diffusers_output, max_pixel_difference
    from memfit.testing.conditioning import save_lora

    model = tiny_models(kind)
    loras = [(str(save_lora(model, tmp_path / "lora", seed=1)), 0.7)]
    ours = memfit.generate(PROMPT, model=model, image=IMAGE, loras=loras, **RUN)
    assert "LoRA(s), unfused" in ours.report.stages[1].note
    reference = diffusers_output(model, ours.settings, loras=check_loras(loras), image=IMAGE)
    assert max_pixel_difference(ours.images, reference) == 0
    assert max_pixel_difference(diffusers_output(model, ours.settings, image=IMAGE), reference) > 0


# Edit Plus takes several input images: the last one portrait, so the output takes its size (128 x 64 here).
PORTRAIT = conditioning.test_image(128, seed=3).resize((128, 64))


def test_plus_with_two_images_equals_diffusers_and_both_images_count(tiny_models, cache_dir):
    from memfit.testing import diffusers_output, max_pixel_difference

    model = tiny_models("qwenimage_edit_plus")
    ours = memfit.generate(PROMPT, model=model, negative_prompt=NEGATIVE, image=[IMAGE, PORTRAIT], **RUN)
    assert (ours.settings.width, ours.settings.height) == PORTRAIT.size
    assert max_pixel_difference(ours.images, diffusers_output(model, ours.settings, image=[IMAGE, PORTRAIT])) == 0
    alone = memfit.generate(PROMPT, model=model, negative_prompt=NEGATIVE, image=PORTRAIT, **RUN)
    assert max_pixel_difference(ours.images, alone.images) > 0  # the first image reaches the run too


def test_plus_encodes_several_images_and_keys_them_in_their_order(tiny_models, cache_dir, tmp_path):
    from memfit.cli.app import main
    from memfit.run.prompt_cache import image_fingerprint

    model = tiny_models("qwenimage_edit_plus")
    files = [tmp_path / "a.png", tmp_path / "b.png"]
    IMAGE.save(files[0])
    PORTRAIT.save(files[1])
    out = tmp_path / "two.safetensors"
    assert main(["encode", "--model", model, "--prompt", PROMPT, "--negative-prompt", NEGATIVE,
                 "--image", str(files[0]), "--image", str(files[1]), "--out", str(out), "--quiet"]) == 0
    direct = memfit.generate(PROMPT, model=model, negative_prompt=NEGATIVE, image=[IMAGE, PORTRAIT], **RUN)
    from_file = memfit.generate(model=model, embeddings=out, image=[str(f) for f in files], **RUN)
    assert from_file.images[0].tobytes() == direct.images[0].tobytes()
    # The order is part of the prompt ("Picture 1", "Picture 2"): swapped, other embeddings, never a stale hit.
    swapped, report = memfit.encode(PROMPT, model=model, image=[PORTRAIT, IMAGE])
    assert report.stages[0].note != "cache hit"
    assert not _equal(swapped, memfit.encode(PROMPT, model=model, image=[IMAGE, PORTRAIT])[0])
    assert len({image_fingerprint([IMAGE, PORTRAIT]), image_fingerprint([PORTRAIT, IMAGE]),
                image_fingerprint(IMAGE)}) == 3
    with pytest.raises(MemfitError, match="encoded with another input image than this --image"):
        memfit.generate(model=model, embeddings=out, image=[files[1], files[0]], **RUN)


def test_a_family_that_takes_one_image_refuses_several(tiny_models, cache_dir):
    model = tiny_models("qwenimage_edit")
    expected = r"QwenImageEditPipeline takes one --image, and 2 were given: pass one \(several are taken by " \
               r"QwenImageEditPlusPipeline\)"
    with pytest.raises(MemfitError, match=expected):
        memfit.generate(PROMPT, model=model, image=[IMAGE, OTHER_IMAGE], **RUN)
    with pytest.raises(MemfitError, match=expected):
        memfit.encode(PROMPT, model=model, image=[IMAGE, OTHER_IMAGE])
    one, _ = memfit.encode(PROMPT, model=model, image=[IMAGE])  # a list of one is that image
    assert _equal(one, memfit.encode(PROMPT, model=model, image=IMAGE)[0])
