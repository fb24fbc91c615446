"""One optimum-intel run in a fresh process, for benchmarks/openvino_vs_optimum.py.

Runs in optimum-intel's own environment (not memfit's: optimum-intel is no memfit dependency), so it
imports nothing from memfit. Prints one JSON line: seconds from process start to the first image,
the median seconds of images 2..N ("images", default 2), peak RSS, and where the first image was saved
(.npy).

    python optimum_intel_child.py '{"ir": DIR, "static": true, "width": 512, "height": 512, "steps": 4,
                                    "guidance": 7.5, "seed": 0, "precision": "bf16", "prompt": "...", "out": FILE}'
"""

from __future__ import annotations

import json
import resource
import statistics
import sys
import time

import psutil


def main() -> None:
    spec = json.loads(sys.argv[1])
    started = psutil.Process().create_time()
    import numpy as np
    import torch
    from optimum.intel import OVDiffusionPipeline

    config = {"INFERENCE_PRECISION_HINT": {"bf16": "bf16", "fp32": "f32"}[spec.get("precision", "bf16")]}
    pipe = OVDiffusionPipeline.from_pretrained(spec["ir"], compile=False, ov_config=config)
    if spec["static"]:
        # optimum-intel's fastest mode: every input shape fixed before compiling.
        pipe.reshape(batch_size=1, height=spec["height"], width=spec["width"], num_images_per_prompt=1)
    pipe.compile()
    pipe.set_progress_bar_config(disable=True)

    def image():
        return pipe(prompt=spec["prompt"], num_inference_steps=spec["steps"], guidance_scale=spec["guidance"], width=spec["width"],
                    height=spec["height"], generator=torch.Generator("cpu").manual_seed(spec["seed"]),
                    output_type="np").images[0]

    first = image()
    first_done = time.time()
    later = []
    for _ in range(spec.get("images", 2) - 1):
        began = time.perf_counter()
        image()
        later.append(time.perf_counter() - began)
    np.save(spec["out"], first)
    print(json.dumps({
        "first_image_s": first_done - started,
        "steady_image_s": statistics.median(later),
        "later_images_s": later,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "image": spec["out"],
    }), flush=True)


if __name__ == "__main__":
    main()
