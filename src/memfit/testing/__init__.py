"""Helpers for testing memfit and code built on it: tiny pipelines, local tokenizers, parity checks."""

from memfit.testing.pipelines import DEFAULT_SIZE, PIPELINE_KINDS, build_pipeline, save_pipeline
from memfit.testing.refiner import build_base_and_refiner, build_refiner, diffusers_refined_image, save_base_and_refiner
from memfit.testing.parity import (assert_matches_diffusers, diffusers_image, diffusers_output, generated_output,
                                   max_pixel_difference)
from memfit.testing.tokenizers import clip_tokenizer, word_tokenizer

__all__ = [
    "DEFAULT_SIZE",
    "PIPELINE_KINDS",
    "assert_matches_diffusers",
    "build_base_and_refiner",
    "build_pipeline",
    "build_refiner",
    "clip_tokenizer",
    "diffusers_image",
    "diffusers_output",
    "diffusers_refined_image",
    "generated_output",
    "max_pixel_difference",
    "save_base_and_refiner",
    "save_pipeline",
    "word_tokenizer",
]
