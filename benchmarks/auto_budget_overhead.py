"""What the automatic budget costs when everything fits: memfit.generate with no budget argument
(auto) against budget="none", interleaved in one process, medians.

    python benchmarks/auto_budget_overhead.py --rounds 5

With auto, each stage is planned (its blocks measured, the plan made and carried out); when
everything fits the plan keeps every weight resident, installs no hook and leaves glibc's allocator
as it is, so the two should take the same time within noise. Uses the built-in demo model (SD 1.5
layout, 64x64, 25 steps). Writes docs/auto_budget_overhead.{json,md}.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=25)
    args = parser.parse_args()
    os.environ["MEMFIT_CACHE"] = "0"  # both encode every time
    import numpy as np

    import memfit
    from common import machine, write_outputs

    memfit.generate("a red circle on a blue background", budget="none", progress=False)  # warm-up: imports, files
    times = {"auto": [], "none": []}
    images = {}
    for round_ in range(args.rounds):
        for mode in (("auto", "none") if round_ % 2 == 0 else ("none", "auto")):
            started = time.perf_counter()
            result = memfit.generate("a red circle on a blue background", budget=mode, steps=args.steps, progress=False)
            times[mode].append(time.perf_counter() - started)
            images[mode] = np.asarray(result.images[0])
            print(mode, f"{times[mode][-1]:.2f} s", flush=True)
    median = {mode: statistics.median(values) for mode, values in times.items()}
    same = bool(np.array_equal(images["auto"], images["none"]))
    table = "\n".join([
        "# The automatic budget when everything fits",
        "",
        f"memfit.generate on the built-in demo model (64x64, {args.steps} steps, fp32, CPU), no budget argument (auto) "
        f"against budget=\"none\", {args.rounds} interleaved rounds in one process; {machine()['cpu_count']} cores "
        "shared with other work: compare the spread of the runs before reading the ratio.",
        "",
        "| budget | median s | runs (s) |",
        "|---|---|---|",
        *[f"| {mode} | {median[mode]:.2f} | {', '.join(f'{t:.2f}' for t in times[mode])} |" for mode in times],
        "",
        f"auto / none = {median['auto'] / median['none']:.3f}; images identical: {same}.",
        "",
    ])
    write_outputs("auto_budget_overhead", {"machine": machine(), "args": vars(args), "times": times,
                                          "median": median, "same_image": same}, table)
    print(table)


if __name__ == "__main__":
    main()
