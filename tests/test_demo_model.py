"""The built-in demo model: its data set, its judge, and its quality on held-out captions.

The quality test runs a small version of scripts/eval_demo_model.py (12 held-out captions, the
shipped generation defaults) on the shipped weights. Bars: background and shape colour >= 90%,
shape >= 75%; see QUALITY_BARS.
"""

from __future__ import annotations

import importlib.util
import pathlib

import numpy as np
import pytest

from memfit.demo import shapes
from memfit.errors import MemfitError

ROOT = pathlib.Path(__file__).resolve().parent.parent

# On 12 captions one miss costs 8.3 points. The full evaluation (56 held-out captions,
# docs/demo_model.md) measured background 100%, shape colour 94.6%, shape 96.4% for the shipped
# model (seed-0 run fine-tuned 1100 more steps). On this 12-caption set it scores background 12/12,
# shape colour 11/12 (91.7%; one caption, "a cyan circle on a green background", draws no shape),
# shape 10/12 (83.3%). The colour bars are the 90% (the current single miss uses up the
# margin). The shape bar is 75% (9/12): one miss below what the set achieves, above the 60%.
QUALITY_BARS = {"background": 0.90, "colour": 0.90, "shape": 0.75}


def _eval_module():
    path = ROOT / "scripts" / "eval_demo_model.py"
    if not path.is_file():
        pytest.skip("scripts/eval_demo_model.py is not in this checkout")
    spec = importlib.util.spec_from_file_location("eval_demo_model", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def one_thread():
    """One torch thread (faster on a small shared machine), restored afterwards."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_dataset_is_deterministic_from_its_seed():
    images_a, captions_a, _ = shapes.make_dataset(24, seed=7, two_shape_fraction=0.3)
    images_b, captions_b, _ = shapes.make_dataset(24, seed=7, two_shape_fraction=0.3)
    images_c, captions_c, _ = shapes.make_dataset(24, seed=8, two_shape_fraction=0.3)
    assert images_a.shape == (24, 64, 64, 3) and images_a.dtype == np.uint8
    assert np.array_equal(images_a, images_b) and captions_a == captions_b
    assert not np.array_equal(images_a, images_c)


def test_held_out_split_is_disjoint_from_training_data():
    held = set(shapes.held_out_combos())
    assert len(held) >= 40
    assert held.isdisjoint(shapes.train_combos())
    assert len(shapes.COLOURS) >= 6 and {"circle", "square", "triangle"} <= set(shapes.SHAPES)
    # Composition is what is tested: every pair of attributes of a held-out combo is seen in training.
    train = shapes.train_combos()
    for colour, shape, background in held:
        assert any(c == colour and s == shape for c, s, _ in train)
        assert any(c == colour and b == background for c, _, b in train)
        assert any(s == shape and b == background for _, s, b in train)
    _, _, scenes = shapes.make_dataset(400, seed=3, two_shape_fraction=0.5)
    assert any(len(scene.shapes) == 2 for scene in scenes)
    for scene in scenes:
        for shape in scene.shapes:
            assert (shape.colour, shape.kind, scene.background) not in held
            assert shape.colour != scene.background


def test_every_caption_word_is_one_token():
    from memfit.testing.tokenizers import clip_tokenizer

    tokenizer = clip_tokenizer(shapes.vocabulary(), model_max_length=16)
    for word in shapes.vocabulary():
        assert len(tokenizer.tokenize(word)) == 1, word
    longest = shapes.caption([("purple", "triangle"), ("yellow", "triangle")], "background")
    assert len(tokenizer(longest).input_ids) <= 16


def test_classifier_is_right_on_ground_truth_images():
    evaluation = _eval_module()
    accuracy = evaluation.classifier_check(shapes.all_combos(), per_combo=2)
    assert accuracy["n"] == 2 * len(shapes.all_combos())
    for field in ("background", "colour", "shape"):
        assert accuracy[field] >= 0.99, (field, accuracy)


def test_model_dir_names_the_retraining_command_when_weights_are_missing(monkeypatch, tmp_path):
    import memfit.demo as demo

    monkeypatch.setattr(demo, "_MODEL_DIR", tmp_path / "model")
    with pytest.raises(MemfitError, match="train_demo_model.py"):
        demo.model_dir()


def test_shipped_model_is_small_and_has_defaults():
    import memfit.demo as demo

    folder = demo.model_dir()
    size = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
    assert size < 30 * 2**20
    assert not list(folder.rglob("*.bin")), "weights must be safetensors"
    defaults = demo.defaults()
    assert set(defaults) >= {"steps", "guidance", "width", "height"}


@pytest.mark.slow
@pytest.mark.slow
def test_demo_model_follows_held_out_prompts(one_thread, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import memfit.demo as demo

    evaluation = _eval_module()
    report = evaluation.evaluate(demo.model_dir(), n=12, seed=0)
    accuracy = report["accuracy"]
    misses = [row for row in report["rows"] if row["pred"] != row["truth"]]
    for field, bar in QUALITY_BARS.items():
        assert accuracy[field] >= bar, f"{field} accuracy {accuracy[field]:.0%} < {bar:.0%}; misses: {misses}"
