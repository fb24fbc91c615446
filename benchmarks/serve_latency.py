"""memfit serve, warm, against a fresh `memfit generate` making the same image (issue 15's benchmark).

    python benchmarks/serve_latency.py                       # built-in demo model, its defaults (25 steps, 64x64)
    python benchmarks/serve_latency.py --arch sd15 --size 256 --steps 4   # real-size SD 1.5, random weights
    python benchmarks/serve_latency.py --requests 50         # + RSS across that many requests

What is timed (wall clock, this machine, one shared memfit store so both sides see the same prompt cache):

  fresh generate  `memfit generate` as a new process, launch to exit (imports, load, plan, run,
                  release, PNG written): what every image costs without a server. --rounds runs, median.
  first request   the server's first request (stages loaded, planned, compiled; nothing warm yet)
  second request  the next request for the image the fresh generate makes (same prompt, seed):
                  the stages are warm, the prompt embeddings come from the cache, as for the fresh run
                  (its prompt is in the store after the first request)
  warm, new prompt  a warm request whose prompt is not cached (the text encoder runs, kept loaded)

The second request's PNG is checked byte for byte against the fresh generate's file. Then --requests
more requests (new seed each, every 5th a new prompt) measure the server's RSS before and after.
Writes docs/serve_latency_<model>.{json,md}.
"""

from __future__ import annotations

import argparse
import base64
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine, write_outputs  # noqa: E402

PROMPT = "a red circle on a blue background"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", choices=("demo", "sd15"), default="demo")
    parser.add_argument("--size", type=int, help="width = height (default: the model's)")
    parser.add_argument("--steps", type=int, help="denoising steps (default: the model's)")
    parser.add_argument("--rounds", type=int, default=3, help="fresh generate runs and second requests (median)")
    parser.add_argument("--requests", type=int, default=50, help="requests for the RSS measurement")
    parser.add_argument("--budget", help="memory budget passed to both sides")
    parser.add_argument("--work", default=os.path.join(tempfile.gettempdir(), "memfit-bench"))
    args = parser.parse_args()

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, MEMFIT_CACHE_DIR=tempfile.mkdtemp(prefix="serve-bench-cache-"), HF_HUB_OFFLINE="1")
    model_args: list[str] = []
    if args.arch == "sd15":
        from common import build_real_size

        model_args = ["--model", str(build_real_size("sd15", work / "sd15"))]
    common_args = model_args + (["--budget", args.budget] if args.budget else [])
    settings = {}
    if args.size:
        settings.update(width=args.size, height=args.size)
    if args.steps:
        settings.update(steps=args.steps)

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen([sys.executable, "-m", "memfit", "serve", *common_args, "--port", str(port)], env=env)
    try:
        started = time.perf_counter()
        while True:
            try:
                if httpx.get(url + "/sdapi/v1/options", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.1)
            if time.perf_counter() - started > 600:
                raise SystemExit("server did not start")
        server_start = time.perf_counter() - started
        process = psutil.Process(server.pid)

        def request(prompt, seed):
            body = {"prompt": prompt, "seed": seed, **settings}
            if "steps" in settings:
                body["steps"] = settings["steps"]
            began = time.perf_counter()
            response = httpx.post(url + "/sdapi/v1/txt2img", json=body, timeout=3600)
            response.raise_for_status()
            return time.perf_counter() - began, base64.b64decode(response.json()["images"][0])

        first, _ = request(PROMPT, 1)
        second, seconds_png = [], None
        for i in range(args.rounds):
            seconds, png = request(PROMPT, 2)
            second.append(seconds)
            seconds_png = png
        new_prompt = [request(f"a green square and a white triangle on a black background {i}", 3)[0]
                      for i in range(args.rounds)]

        fresh = []
        out = work / "fresh.png"
        flags = []
        for key, flag in (("width", "--width"), ("height", "--height"), ("steps", "--steps")):
            if key in settings:
                flags += [flag, str(settings[key])]
        for _ in range(args.rounds):
            began = time.perf_counter()
            subprocess.run([sys.executable, "-m", "memfit", "generate", *common_args, "--prompt", PROMPT, "--seed", "2",
                            *flags, "--quiet", "--out", str(out)], env=env, check=True)
            fresh.append(time.perf_counter() - began)
        same_bytes = out.read_bytes() == seconds_png

        rss_before = process.memory_info().rss
        load = []
        for i in range(args.requests):
            prompt = PROMPT if i % 5 else f"a blue circle on a red background {i}"
            load.append(request(prompt, 100 + i)[0])
        rss_after = process.memory_info().rss
    finally:
        server.terminate()
        server.wait(120)

    name = f"serve_latency_{args.arch}"
    median_fresh, median_second = statistics.median(fresh), statistics.median(second)
    data = {
        "machine": machine(), "arch": args.arch, "settings": settings or "model defaults", "budget": args.budget,
        "server_start_s": server_start, "first_request_s": first, "second_request_s": second,
        "warm_new_prompt_s": new_prompt, "fresh_generate_s": fresh, "speedup_second_vs_fresh": median_fresh / median_second,
        "second_request_png_equals_fresh_generate": same_bytes, "requests": args.requests,
        "load_request_s": load, "rss_before_bytes": rss_before, "rss_after_bytes": rss_after,
        "rss_growth_bytes": rss_after - rss_before, "server_exit_code": server.returncode,
    }
    MiB = 2**20
    table = "\n".join([
        f"# memfit serve: warm requests against a fresh `memfit generate` ({args.arch})",
        "",
        f"Model: {'built-in demo model' if args.arch == 'demo' else 'SD 1.5 architecture, random weights'}; "
        f"settings: {settings or 'the model defaults'}; budget: {args.budget or 'none'}; "
        f"{machine()['cpu_count']} CPU cores (shared); medians of {args.rounds}. `python benchmarks/serve_latency.py"
        f"{' --arch ' + args.arch if args.arch != 'demo' else ''}`.",
        "",
        "| what | seconds |",
        "|---|---|",
        f"| fresh `memfit generate` (new process, launch to exit) | {median_fresh:.2f} |",
        f"| server start (launch to first answer) | {server_start:.2f} |",
        f"| first request (stages loaded, planned) | {first:.2f} |",
        f"| **second request, same image** (warm, prompt cached) | **{median_second:.2f}** ({median_fresh / median_second:.1f}x faster) |",
        f"| warm request, new prompt | {statistics.median(new_prompt):.2f} |",
        f"| {args.requests} more requests: median | {statistics.median(load):.2f} |",
        "",
        f"The second request's PNG equals the fresh generate's file byte for byte: **{same_bytes}**.",
        f"Server RSS over the {args.requests} requests: {rss_before / MiB:.1f} MiB -> {rss_after / MiB:.1f} MiB "
        f"({(rss_after - rss_before) / MiB:+.1f} MiB). Server exit after SIGTERM: {server.returncode}.",
        "",
    ])
    write_outputs(name, data, table)
    print(table)


if __name__ == "__main__":
    main()
