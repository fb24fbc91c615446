"""The demo model's synthetic data set, and the pixel-statistics classifier that grades it.

Images are flat-coloured shapes (circle, square, triangle) on a plain background, drawn in code,
deterministic from a seed; nothing is downloaded. Captions read "a red circle on a blue
background", or for two shapes "a red circle and a green square on a white background" (left
shape first).

Colours sit near the corners of the RGB cube, at least ~140 apart, so that a nearest-colour rule
on pixel statistics names them reliably even after a VAE blurs them a little.

The held-out split: of the 8 x 7 x 3 = 168 (shape colour, shape, background) combinations, those
with (colour index + shape index + background index) % 3 == 0 (56 of them) never appear in
training, not even as one of two shapes. Every (colour, background), (colour, shape) and
(shape, background) pair is still seen in training, so held-out captions test composition.

The classifier (`classify`) uses no learned model, only pixel statistics:
- background colour: the median of the 2-pixel border ring, named by the nearest colour;
- foreground mask: pixels farther than 80 (RGB Euclidean) from that median background;
  the largest 4-connected component of it is the shape;
- shape colour: the median colour of the shape's pixels (its 1-pixel edge eroded away), nearest name;
- shape: template matching, the IoU of the mask with a circle, a square and an apex-up triangle
  each inscribed in the mask's bounding box; the best IoU wins. (Fill ratios of the bounding box
  are circle ~0.785, square 1.0, triangle 0.5, so the templates are well apart.)
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import numpy as np

COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30),
    "green": (30, 170, 50),
    "blue": (30, 60, 220),
    "yellow": (240, 220, 40),
    "purple": (170, 40, 200),
    "cyan": (40, 200, 220),
    "white": (245, 245, 245),
    "black": (20, 20, 20),
}
COLOUR_NAMES: tuple[str, ...] = tuple(COLOURS)
SHAPES: tuple[str, ...] = ("circle", "square", "triangle")
IMAGE_SIZE = 64

Combo = tuple[str, str, str]  # (shape colour, shape, background colour)


def all_combos() -> list[Combo]:
    """Every (shape colour, shape, background) with the shape colour != the background colour."""
    return [
        (colour, shape, background)
        for colour in COLOUR_NAMES
        for shape in SHAPES
        for background in COLOUR_NAMES
        if colour != background
    ]


def is_held_out(combo: Combo) -> bool:
    colour, shape, background = combo
    index = COLOUR_NAMES.index(colour) + SHAPES.index(shape) + COLOUR_NAMES.index(background)
    return index % 3 == 0


def train_combos() -> list[Combo]:
    return [combo for combo in all_combos() if not is_held_out(combo)]


def held_out_combos() -> list[Combo]:
    return [combo for combo in all_combos() if is_held_out(combo)]


def vocabulary() -> list[str]:
    """Every word a caption can use (the demo tokenizer's vocabulary), longest first.

    `clip_tokenizer` ranks merges in word order; longest first lets every word win its own merges,
    so each word is exactly one token (checked by the tests).
    """
    words = ["a", "and", "on", "background", *COLOUR_NAMES, *SHAPES]
    return sorted(words, key=lambda word: (-len(word), word))


@dataclass(frozen=True)
class Shape:
    colour: str
    kind: str
    cx: float  # centre, in pixels of the final image
    cy: float
    size: float  # side of the bounding box, in pixels


@dataclass(frozen=True)
class Scene:
    background: str
    shapes: tuple[Shape, ...] = field(default_factory=tuple)

    @property
    def caption(self) -> str:
        return caption([(s.colour, s.kind) for s in self.shapes], self.background)


def caption(shapes: list[tuple[str, str]], background: str) -> str:
    """'a red circle on a blue background'; shapes are listed left to right, joined by 'and'."""
    things = " and ".join(f"a {colour} {kind}" for colour, kind in shapes)
    return f"{things} on a {background} background"


def combo_caption(combo: Combo) -> str:
    colour, shape, background = combo
    return caption([(colour, shape)], background)


def render(scene: Scene, size: int = IMAGE_SIZE, supersample: int = 4) -> np.ndarray:
    """Draw a scene as an (size, size, 3) uint8 array, anti-aliased by supersampling."""
    from PIL import Image, ImageDraw

    big = size * supersample
    image = Image.new("RGB", (big, big), COLOURS[scene.background])
    draw = ImageDraw.Draw(image)
    for shape in scene.shapes:
        half = shape.size * supersample / 2
        cx, cy = shape.cx * supersample, shape.cy * supersample
        box = (cx - half, cy - half, cx + half, cy + half)
        fill = COLOURS[shape.colour]
        if shape.kind == "circle":
            draw.ellipse(box, fill=fill)
        elif shape.kind == "square":
            draw.rectangle(box, fill=fill)
        elif shape.kind == "triangle":
            draw.polygon([(cx, cy - half), (cx + half, cy + half), (cx - half, cy + half)], fill=fill)
        else:
            raise ValueError(f"unknown shape {shape.kind!r}")
    image = image.resize((size, size), Image.Resampling.BOX)
    return np.asarray(image, dtype=np.uint8)


def sample_single(rng: random.Random, combo: Combo, size: int = IMAGE_SIZE) -> Scene:
    colour, kind, background = combo
    side = rng.uniform(0.45, 0.70) * size
    margin = side / 2 + 3
    cx = rng.uniform(margin, size - margin)
    cy = rng.uniform(margin, size - margin)
    return Scene(background, (Shape(colour, kind, cx, cy, side),))


def sample_pair(rng: random.Random, left: Combo, right: Combo, size: int = IMAGE_SIZE) -> Scene:
    """Two shapes side by side on `left`'s background (both combos must share it)."""
    background = left[2]
    shapes = []
    for half_index, (colour, kind, _) in enumerate((left, right)):
        side = rng.uniform(0.28, 0.40) * size
        margin = side / 2 + 2
        lo = half_index * size / 2 + margin
        hi = (half_index + 1) * size / 2 - margin
        cx = rng.uniform(lo, hi)
        cy = rng.uniform(margin, size - margin)
        shapes.append(Shape(colour, kind, cx, cy, side))
    return Scene(background, tuple(shapes))


def sample_scenes(n: int, seed: int, combos: list[Combo] | None = None, two_shape_fraction: float = 0.0) -> list[Scene]:
    """`n` random scenes using only `combos` (default: the training combos), deterministic from `seed`.

    Single-shape scenes cycle through the combos in a shuffled order so every combo is equally
    represented; a two-shape scene picks two combos sharing a background (and never the same
    colour twice), so it teaches nothing about the held-out combos either.
    """
    combos = list(train_combos() if combos is None else combos)
    rng = random.Random(seed)
    by_background: dict[str, list[Combo]] = {}
    for combo in combos:
        by_background.setdefault(combo[2], []).append(combo)
    order: list[Combo] = []
    scenes = []
    for _ in range(n):
        if two_shape_fraction > 0 and rng.random() < two_shape_fraction:
            left = rng.choice(combos)
            options = [c for c in by_background[left[2]] if c[0] != left[0]]
            if options:
                scenes.append(sample_pair(rng, left, rng.choice(options)))
                continue
        if not order:
            order = list(combos)
            rng.shuffle(order)
        scenes.append(sample_single(rng, order.pop()))
    return scenes


def make_dataset(
    n: int, seed: int, combos: list[Combo] | None = None, two_shape_fraction: float = 0.0
) -> tuple[np.ndarray, list[str], list[Scene]]:
    """(images (n, 64, 64, 3) uint8, captions, scenes), deterministic from `seed`."""
    scenes = sample_scenes(n, seed, combos, two_shape_fraction)
    images = np.stack([render(scene) for scene in scenes]) if scenes else np.zeros((0, IMAGE_SIZE, IMAGE_SIZE, 3), np.uint8)
    return images, [scene.caption for scene in scenes], scenes


# ---------------------------------------------------------------------------------------------
# The classifier: pixel statistics and template matching only.

_PALETTE = np.array([COLOURS[name] for name in COLOUR_NAMES], dtype=np.float32)
FOREGROUND_DISTANCE = 80.0


def nearest_colour(rgb: np.ndarray) -> str:
    distances = np.linalg.norm(_PALETTE - np.asarray(rgb, dtype=np.float32)[None, :], axis=1)
    return COLOUR_NAMES[int(np.argmin(distances))]


def _largest_component(mask: np.ndarray) -> np.ndarray:
    """The largest 4-connected component of a boolean mask (a plain flood fill, no scipy)."""
    height, width = mask.shape
    labels = np.zeros(mask.shape, dtype=np.int32)
    best_label, best_size, current = 0, 0, 0
    for y0, x0 in zip(*np.nonzero(mask)):
        if labels[y0, x0]:
            continue
        current += 1
        labels[y0, x0] = current
        stack, count = [(y0, x0)], 0
        while stack:
            y, x = stack.pop()
            count += 1
            for ny, nx in ((y - 1, x), (y + 1, x), (y, x - 1), (y, x + 1)):
                if 0 <= ny < height and 0 <= nx < width and mask[ny, nx] and not labels[ny, nx]:
                    labels[ny, nx] = current
                    stack.append((ny, nx))
        if count > best_size:
            best_label, best_size = current, count
    return labels == best_label if best_size else np.zeros_like(mask)


def _templates(height: int, width: int) -> dict[str, np.ndarray]:
    """Circle, square and apex-up triangle inscribed in a height x width box, as boolean masks."""
    ys, xs = np.mgrid[0:height, 0:width].astype(np.float32)
    ys, xs = (ys + 0.5) / height, (xs + 0.5) / width  # pixel centres in [0, 1]
    circle = (xs - 0.5) ** 2 + (ys - 0.5) ** 2 <= 0.25
    square = np.ones((height, width), dtype=bool)
    triangle = np.abs(xs - 0.5) <= ys / 2  # apex at the top centre, base along the bottom
    return {"circle": circle, "square": square, "triangle": triangle}


@dataclass(frozen=True)
class Prediction:
    background: str
    colour: str | None
    shape: str | None
    scores: dict[str, float] = field(default_factory=dict)  # template IoUs


def classify(image: np.ndarray) -> Prediction:
    """Name the background colour, the shape colour and the shape of a single-shape image."""
    pixels = np.asarray(image, dtype=np.float32)[..., :3]
    border = np.concatenate(
        [pixels[:2].reshape(-1, 3), pixels[-2:].reshape(-1, 3), pixels[:, :2].reshape(-1, 3), pixels[:, -2:].reshape(-1, 3)]
    )
    background_rgb = np.median(border, axis=0)
    background = nearest_colour(background_rgb)
    mask = np.linalg.norm(pixels - background_rgb, axis=-1) > FOREGROUND_DISTANCE
    mask = _largest_component(mask)
    if mask.sum() < 9:
        return Prediction(background, None, None)
    # Drop the anti-aliased rim (pixels with a background neighbour) before taking the colour.
    inner = mask.copy()
    inner[1:, :] &= mask[:-1, :]
    inner[:-1, :] &= mask[1:, :]
    inner[:, 1:] &= mask[:, :-1]
    inner[:, :-1] &= mask[:, 1:]
    body = pixels[inner] if inner.sum() >= 4 else pixels[mask]
    colour = nearest_colour(np.median(body, axis=0))
    ys, xs = np.nonzero(mask)
    crop = mask[ys.min() : ys.max() + 1, xs.min() : xs.max() + 1]
    scores = {}
    for name, template in _templates(*crop.shape).items():
        scores[name] = float((crop & template).sum() / max((crop | template).sum(), 1))
    shape = max(scores, key=scores.get)
    return Prediction(background, colour, shape, scores)
