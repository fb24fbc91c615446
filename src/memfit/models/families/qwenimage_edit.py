"""QwenImageEditPipeline (Qwen-Image-Edit) and QwenImageEditPlusPipeline (Qwen-Image-Edit-2509 and later):
QwenImage's components plus a Qwen2-VL processor, editing an input image (--image). Every run needs --image.

Everything but the input image is QwenImage's (memfit.models.families.qwenimage): true CFG as memfit's
guidance (only with a negative prompt), native unequal lengths, packed latents, the decode, LoRAs into the
transformer.

The input image goes two ways, as the pipelines' __call__ sends it:
- to the text encoder: the prompt is encoded *with* the image (Qwen2.5-VL sees it through the pipeline's
  processor), so the encode stage needs --image, the embeddings depend on it, and memfit's prompt cache keys
  them by the image's content (memfit.run.prompt_cache). An embeddings file records that content too, and
  generating from it with another image is refused. Edit shows the text encoder the image resized to about
  1024 x 1024 pixels at its aspect ratio; Edit Plus resizes it to about 384 x 384.
- to the transformer: the VAE's encoder turns the image, resized to about 1024 x 1024 pixels at its aspect
  ratio, into latents in the loop set-up (so the VAE's encoder is loaded and planned in the denoise stage), and
  their patches join every transformer call. There is no --strength.

Edit Plus takes several input images (--image repeated; memfit.generate(..., image=[A, B])), in the order given: each
reaches the text encoder and the VAE as above, the prompt cache and an embeddings file key them by all their
contents in that order, and without --width/--height the output takes the last image's size, whose aspect ratio the
pipeline's own default takes. The other families take one image and refuse several.

Size: the pipelines take a width and height (their default is the 1024 x 1024 area); memfit passes the size
asked for, without --width/--height the input image's size rounded down to a multiple of 16 (as for every
img2img family).

Processor: the folder's processor is a transformers Qwen2VLProcessor, whose video half needs torchvision to
load, though the pipelines never give it a video. Where torchvision is missing memfit loads the processor from
the same files without its video half (the image processor and the tokenizer are the same, so are the
embeddings); where it is installed diffusers loads the processor itself.
"""

from __future__ import annotations

import functools

from memfit.errors import MemfitError
from memfit.models.families.base import IMG2IMG
from memfit.models.families.qwenimage import QwenImageAdapter

# The areas the pipelines resize the input image to for the VAE (both) and for the text encoder (Edit Plus's
# CONDITION_IMAGE_SIZE; Edit shows the text encoder the VAE's size).
VAE_IMAGE_AREA = 1024 * 1024
PLUS_CONDITION_IMAGE_AREA = 384 * 384
# Qwen2.5-VL merges 2x2 patches of 14 pixels into one text token.
PIXELS_PER_IMAGE_TOKEN = 28 * 28


class QwenImageEditAdapter(QwenImageAdapter):
    class_name = "QwenImageEditPipeline"
    tasks = {IMG2IMG: "QwenImageEditPipeline"}
    encode_components = ("tokenizer", "text_encoder", "processor")
    text_encoders = ("text_encoder", "tokenizer", "processor")  # the processor's image settings shape the embeddings
    prompt_sees_image = True
    needs_image = True
    condition_image_area = VAE_IMAGE_AREA  # the pixels of the image the text encoder sees
    # The text encoder sees the prompt (at most QwenImage's 1024 tokens) and the image's tokens.
    max_text_tokens = QwenImageAdapter.max_text_tokens + VAE_IMAGE_AREA // PIXELS_PER_IMAGE_TOKEN

    def context_tokens(self, settings):
        # The input image's latent patches (at about VAE_IMAGE_AREA) join every transformer call.
        return self.max_text_tokens + VAE_IMAGE_AREA // self.size_multiple() ** 2

    def load_apart(self, folder, names):
        if "processor" not in names or self.classes.get("processor", ("", ""))[1] != "Qwen2VLProcessor":
            return {}
        from transformers.utils import is_torchvision_available

        if is_torchvision_available():  # diffusers loads it whole, as a plain diffusers run does
            return {}
        return {"processor": load_image_only_processor(folder / "processor")}

    def prompt_images(self, pipe, image):
        """The input image as the pipeline's __call__ hands it to encode_prompt: resized to about 1024 x 1024."""
        from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit import (
            calculate_dimensions,
        )

        width, height, _ = calculate_dimensions(self.condition_image_area, image.size[0] / image.size[1])
        return pipe.image_processor.resize(image, height, width)

    def encode(self, pipe, settings, with_negative, image=None):
        if image is None:
            raise MemfitError(f"{self.class_name} encodes the prompt together with the image it edits: pass --image IMG "
                              "(memfit.encode(..., image=...)).")
        device = pipe._execution_device
        prompt_image = self.prompt_images(pipe, image)
        embeddings = {}
        prompts = [("", settings.prompt)] + ([("negative_", settings.negative_prompt or "")] if with_negative else [])
        for prefix, prompt in prompts:
            embeds, mask = pipe.encode_prompt(prompt=prompt, image=prompt_image, device=device, num_images_per_prompt=1,
                                              max_sequence_length=512)  # __call__'s default
            embeddings[f"{prefix}prompt_embeds"] = embeds
            if mask is not None:
                embeddings[f"{prefix}prompt_embeds_mask"] = mask
        return embeddings


class QwenImageEditPlusAdapter(QwenImageEditAdapter):
    class_name = "QwenImageEditPlusPipeline"
    tasks = {IMG2IMG: "QwenImageEditPlusPipeline"}
    takes_several_images = True  # --image repeated: a list, as the pipeline takes it
    condition_image_area = PLUS_CONDITION_IMAGE_AREA
    max_text_tokens = QwenImageAdapter.max_text_tokens + PLUS_CONDITION_IMAGE_AREA // PIXELS_PER_IMAGE_TOKEN

    def prompt_images(self, pipe, image):
        """The input image(s) as the pipeline's __call__ hands them to encode_prompt: a list, each about 384 x 384
        at its aspect ratio ("Picture 1", "Picture 2", ... in the prompt's template, in the order given)."""
        from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus import (
            calculate_dimensions,
        )

        resized = []
        for each in image if isinstance(image, (list, tuple)) else [image]:
            width, height = calculate_dimensions(self.condition_image_area, each.size[0] / each.size[1])
            resized.append(pipe.image_processor.resize(each, height, width))
        return resized


@functools.cache
def _image_only_processor_class():
    from transformers import Qwen2VLProcessor

    class ImageOnlyQwen2VLProcessor(Qwen2VLProcessor):
        """Qwen2VLProcessor without its video processor (which needs torchvision): the image and text half,
        which is all the edit pipelines call."""

        @classmethod
        def get_attributes(cls):
            return ["image_processor", "tokenizer"]

        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
            super().__init__(image_processor, tokenizer, chat_template=chat_template, **kwargs)

    return ImageOnlyQwen2VLProcessor


def image_only_processor(image_processor, tokenizer):
    """A Qwen2VLProcessor of ``image_processor`` and ``tokenizer`` without a video processor."""
    return _image_only_processor_class()(image_processor, tokenizer)


def load_image_only_processor(path):
    """The Qwen2VLProcessor saved at ``path`` (a model folder's processor/), without its video processor."""
    from transformers import AutoImageProcessor, AutoTokenizer

    if not path.is_dir():
        raise MemfitError(f"{path} is missing: the model folder's processor (a Qwen2VLProcessor) is needed to encode "
                          "the prompt with the image; re-download the model.")
    try:
        return image_only_processor(AutoImageProcessor.from_pretrained(path), AutoTokenizer.from_pretrained(path))
    except (OSError, ValueError) as exc:
        raise MemfitError(f"Could not load the processor in {path} ({type(exc).__name__}: {exc}); "
                          "re-download the model.") from None

