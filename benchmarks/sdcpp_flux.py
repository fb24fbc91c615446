"""FLUX.1-dev from the four files a ComfyUI user holds, in a 6 GiB container with no flag, side by side with
stable-diffusion.cpp on the same files.

    python benchmarks/sdcpp_flux.py --sd /work/sdcpp/build/bin/sd-cli --models /work/bench-models/flux-files \\
        --size 256 --steps 4 --rounds 1 --caps 6,4

The files (built under ``--models`` once, about 12.5 GB; random weights at the real size and layout: speed
and memory do not depend on the values):

* ``flux1-dev-Q4_K.gguf``: the 12B transformer in Black Forest Labs' keys as city96's files hold it, every
  weight whose rows are whole 256-blocks in Q4_K (random blocks, their minimum set so the values centre on
  zero), the rest F32 (6.8 GB, the size of city96's Q4_K_S);
* ``t5xxl_fp8_e4m3fn.safetensors``: the T5-XXL encoder in transformers' names, its 2-D weights in
  float8_e4m3fn and the rest fp16, as Comfy's file;
* ``clip_l.safetensors`` (fp16) and ``ae.safetensors`` (the 16-channel VAE in the original keys, fp32), as
  ComfyUI's folders hold them;
* ``flux-dev-configs``: FLUX.1-dev's configs, scheduler and memfit's offline tokenizers, no weights (what
  ``--config`` gives memfit where the user has no diffusers folder; sd.cpp needs none).

memfit: ``memfit generate --model flux1-dev-Q4_K.gguf --config flux-dev-configs --component
text_encoder_2=t5xxl_fp8_e4m3fn.safetensors --component text_encoder=clip_l.safetensors --component
vae=ae.safetensors`` and no other flag (its automatic budget reads the container's limit), under each of
``--caps`` and without one. sd.cpp: ``sd-cli --diffusion-model ... --t5xxl ... --clip_l ... --vae ...`` with
the same size, steps, guidance 3.5 (no CFG, as FLUX.1-dev), Euler, without a cap and under the largest with
``--mmap`` (its smallest setting). ``--add`` runs more rounds (or ``--only`` some configurations) into the
page's JSON; ``--rerender`` rewrites the page from it (with the remarks written there). Both at ``--threads`` threads. One unmeasured memfit run (one step) first
hashes the files into a cache of the benchmark's own, as a user's first run does (its time is reported).

Each run a fresh process in a child memory cgroup, every file evicted from the page cache first; rounds
interleave the configurations (order reversed every other round). Writes docs/sdcpp_flux.{json,md}.
"""

from __future__ import annotations

import time

STARTED = time.perf_counter()

import argparse
import json
import os
import resource
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

PROMPT = "a lighthouse at dusk"
GUIDANCE = 3.5
GiB = 2**30
FILES = {"transformer": "flux1-dev-Q4_K.gguf", "text_encoder_2": "t5xxl_fp8_e4m3fn.safetensors",
         "text_encoder": "clip_l.safetensors", "vae": "ae.safetensors"}
SDCPP_FLAGS = {"transformer": "--diffusion-model", "text_encoder_2": "--t5xxl", "text_encoder": "--clip_l",
               "vae": "--vae"}


# --- the files ----------------------------------------------------------------------------------------

def build_files(models: Path) -> dict[str, Path]:
    """The four files and the configs folder under ``models``, each written once (a partial file never stays)."""
    from quantized import flux_configs, real_gguf

    models.mkdir(parents=True, exist_ok=True)
    flux_configs(models)
    real_gguf(models, "Q4_K")  # FILES["transformer"]
    writers = {"text_encoder_2": _write_t5, "text_encoder": _write_clip_l, "vae": _write_ae}
    for component, write in writers.items():
        path = models / FILES[component]
        if not path.exists():
            started = time.perf_counter()
            partial = path.with_name(path.name + ".partial")
            write(partial)
            partial.rename(path)
            print(f"wrote {path} ({path.stat().st_size / 1e9:.2f} GB, {time.perf_counter() - started:.0f} s)",
                  flush=True)
    return {component: models / name for component, name in FILES.items()}


def _spec(name: str):
    from memfit.models.archs import get_arch

    return next(spec for spec in get_arch("flux").components if spec.name == name)


def _write_t5(path: Path) -> None:
    import torch
    from build_flux_random import meta_model, random_tensor, tensors_to_write
    from safetensors.torch import save_file

    generator = torch.Generator().manual_seed(1)
    tensors = {}
    for key, shape in tensors_to_write(meta_model(_spec("text_encoder_2"))):
        if key == "encoder.embed_tokens.weight":  # tied to shared.weight: the file keeps it once
            continue
        value = random_tensor(key, shape, torch.float32, generator)
        weight = len(shape) == 2 and key.endswith(".weight")
        tensors[key] = value.to(torch.float8_e4m3fn if weight else torch.float16)
    save_file(tensors, str(path))


def _write_clip_l(path: Path) -> None:
    import torch
    import transformers
    from safetensors.torch import save_file

    torch.manual_seed(2)
    config = transformers.CLIPTextConfig(**dict(_spec("text_encoder").config))
    state = {("" if key.startswith("text_model.") else "text_model.") + key: value  # ComfyUI's names, any transformers
             for key, value in transformers.CLIPTextModel(config).to(torch.float16).state_dict().items()}
    state["text_model.embeddings.position_ids"] = torch.arange(config.max_position_embeddings)[None]
    save_file({key: value.contiguous() for key, value in state.items()}, str(path))


def _write_ae(path: Path) -> None:
    import diffusers
    import torch
    from safetensors.torch import save_file

    from memfit.testing.single_file import ldm_vae_state_dict

    torch.manual_seed(3)
    vae = diffusers.AutoencoderKL.from_config(dict(_spec("vae").config))
    save_file({key: value.contiguous() for key, value in ldm_vae_state_dict(vae).items()}, str(path))


# --- the runs -----------------------------------------------------------------------------------------

def configurations(caps: list[float]) -> list[tuple[str, float | None]]:
    """(system, cap in GiB or None): memfit under every cap and without one, sd.cpp without one and under the
    largest cap."""
    return [*(("memfit", cap) for cap in caps), ("memfit", None), ("sd.cpp", None), ("sd.cpp", max(caps))]


def sdcpp_command(args, files: dict[str, Path], capped: bool, image: str, prompt: str) -> list[str]:
    """``capped``: with --mmap, its smallest setting."""
    command = [args.sd]
    for component, flag in SDCPP_FLAGS.items():
        command += [flag, str(files[component])]
    command += ["-p", prompt, "-W", str(args.size), "-H", str(args.size), "--steps", str(args.steps), "--cfg-scale",
                "1.0", "--guidance", str(GUIDANCE), "--sampling-method", "euler", "-s", "0", "-t", str(args.threads),
                "-o", image, "-v"]
    return command + (["--mmap"] if capped else [])


def memfit_cli(args, files: dict[str, Path]) -> list[str]:
    """The `memfit generate` line the child's memfit.generate call equals."""
    command = ["memfit", "generate", "--model", str(files["transformer"]), "--config", str(args.models / "flux-dev-configs")]
    for component in ("text_encoder_2", "text_encoder", "vae"):
        command += ["--component", f"{component}={files[component]}"]
    return command + ["--prompt", PROMPT, "--steps", str(args.steps), "--width", str(args.size), "--height",
                      str(args.size), "--threads", str(args.threads), "--out", "out.png"]


def run_memfit_child(options: dict) -> dict:
    """Inside the measured child: one generation with no budget flag, its stages and peak RSS."""
    import torch

    torch.set_num_threads(options["threads"])
    import memfit
    from memfit.run.memory import process_peak_rss

    files = options["files"]
    result = memfit.generate(options["prompt"], model=files["transformer"], config=options["config"],
                             components={k: v for k, v in files.items() if k != "transformer"},
                             steps=options["steps"], guidance=GUIDANCE, width=options["size"], height=options["size"],
                             threads=options["threads"], progress=False)
    finished = time.perf_counter()
    result.images[0].save(options["image"])
    usage = resource.getrusage(resource.RUSAGE_SELF)
    row = {"wall_s": finished - STARTED, "cpu_s": usage.ru_utime + usage.ru_stime, "peak_rss": process_peak_rss(),
           "budget": result.report.budget,
           "stages": {s.stage: {"seconds": s.seconds, "peak": s.peak_bytes, "tiers": s.tiers, "strategy": s.strategy}
                      for s in result.report.stages}}
    for stage in ("encode", "denoise", "decode"):
        row[f"{stage}_s"] = row["stages"].get(stage, {}).get("seconds")
    return row


def measure(system: str, cap: float | None, args, files: dict[str, Path], image: str, prompt: str,
            steps: int | None = None) -> dict:
    from sdcpp import capped_row

    from memfit.testing.cgroup import evict_page_cache

    if system == "sd.cpp":
        child = [sys.executable, str(Path(__file__).parent / "sdcpp.py"), "--child-sdcpp",
                 json.dumps(sdcpp_command(args, files, cap is not None, image, prompt))]
    else:
        options = {"files": {k: str(v) for k, v in files.items()}, "config": str(args.models / "flux-dev-configs"),
                   "steps": steps or args.steps, "size": args.size, "threads": args.threads, "image": image,
                   "prompt": prompt}
        child = [sys.executable, __file__, "--child-memfit", json.dumps(options)]
    for path in files.values():
        evict_page_cache(path)
    env = {**os.environ, "MEMFIT_CACHE_DIR": args.cache_dir, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": str(args.threads)}
    return capped_row(child, {"system": system, "cap_gib": cap}, cap, timeout=args.timeout, env=env)


def label(row: dict) -> str:
    cap = f"{row['cap_gib']:g} GiB cap" if row["cap_gib"] else "no cap"
    extra = " (--mmap)" if row["system"] == "sd.cpp" and row["cap_gib"] else ""
    return f"{row['system']}{extra}, {cap}"


# --- the report ---------------------------------------------------------------------------------------

def render(data: dict) -> str:
    s = data["settings"]
    lines = [(f"# FLUX.1-dev from ComfyUI's files: memfit and stable-diffusion.cpp ({s['size']}x{s['size']}, "
              f"{s['steps']} steps, {s['threads']} threads)"), "",
             f"`python benchmarks/sdcpp_flux.py {data['command']}` on {data['machine']['cpu']}, "
             f"{data['machine']['cpu_count']} cores (shared with other work: read the pairs of a round, CPU seconds "
             "and memory more than wall seconds). Both read the same four files (random weights at the real size and "
             "layout): " + ", ".join(f"`{Path(p).name}` {b / 1e9:.2f} GB" for p, b in data["file_bytes"].items())
             + f". stable-diffusion.cpp: {data['sdcpp_version']}. memfit with no flag; its first run (one step, "
             f"unmeasured) hashed the files into its cache: {data['first_run_s']:.0f} s.", "",
             "| configuration | outcome | wall s | CPU s | encode s | denoise s | s / step | decode s | peak RSS | cgroup peak |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for e in data["summary"]:
        cells = [_num(e.get(k)) for k in ("wall_s", "cpu_s", "encode_s", "denoise_s", "step_s", "decode_s")]
        lines.append(f"| {e['label']} | {e['outcome']} | " + " | ".join(cells)
                     + f" | {_gib(e.get('peak_rss'))} | {_gib(e.get('cgroup_peak'))} |")
    lines += ["", *data.get("remarks", []), "", "Per run:", ""]
    for r in data["rows"]:
        what = (f"{r['wall_s']:.1f} s, peak RSS {_gib(r['peak_rss'])}, cgroup peak {_gib(r['cgroup_peak'])}"
                if r["completed"] else "killed (out of memory)" if r["killed"] else f"failed: {r.get('error')}")
        lines.append(f"- round {r['round']}: {label(r)}: {what}")
        if r.get("stages"):
            for stage, info in r["stages"].items():
                tiers = "; ".join(f"{c}: " + ", ".join(f"{t} {_gib(b)}" for t, b in tier.items() if b)
                                  for c, tier in (info.get("tiers") or {}).items())
                lines.append(f"  - {stage}: {info['seconds']:.1f} s, peak {_gib(info['peak'])}"
                             + (f", {tiers}" if tiers else ""))
        if r.get("params_mb"):
            p = r["params_mb"]
            lines.append(f"  - sd.cpp's weights in memory: {p['total']:.0f} MB (text encoders {p['text_encoder']:.0f}, "
                         f"transformer {p['unet']:.0f}, VAE {p['vae']:.0f})")
    lines += ["", "Commands (the prompt varies per run):", "", f"- memfit: `{' '.join(data['commands']['memfit'])}`",
              f"- sd.cpp: `{' '.join(data['commands']['sd.cpp'])}` (`--mmap` added under the cap)", ""]
    return "\n".join(lines)


def summarize(rows: list[dict]) -> list[dict]:
    import statistics

    out = []
    seen = []
    for row in rows:
        if (row["system"], row["cap_gib"]) not in seen:
            seen.append((row["system"], row["cap_gib"]))
    for system, cap in sorted(seen, key=lambda c: (c[0] != "memfit", c[1] is None, -(c[1] or 0))):
        runs = [r for r in rows if r["system"] == system and r["cap_gib"] == cap]
        if not runs:
            continue
        done = [r for r in runs if r["completed"]]
        entry = {"label": label(runs[0]), "outcome": f"completed {len(done)}/{len(runs)}"
                 + ("" if len(done) == len(runs) else f", killed {sum(r['killed'] for r in runs)}")}
        for field in ("wall_s", "cpu_s", "encode_s", "denoise_s", "decode_s", "peak_rss", "cgroup_peak"):
            values = [r[field] for r in (done or runs) if r.get(field) is not None]
            entry[field] = statistics.median(values) if values else None
        entry["step_s"] = None if entry["denoise_s"] is None else entry["denoise_s"] / runs[0]["steps"]
        out.append(entry)
    return out


def _num(value) -> str:
    return "-" if value is None else f"{value:.1f}"


def _gib(value) -> str:
    return "-" if value is None else f"{value / GiB:.2f} GiB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sd", help="stable-diffusion.cpp's sd-cli binary")
    parser.add_argument("--sd-origin", default="as vendored in the stable-diffusion-cpp-python 0.4.7 sdist (ggml 0.9.8), "
                        "built for the CPU (Release, native flags, OpenMP)")
    parser.add_argument("--models", type=Path, default=Path("/work/bench-models/flux-files"))
    parser.add_argument("--size", type=int, default=256)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--caps", default="6", help="the containers' memory in GiB, comma-separated (memfit runs "
                        "under each, sd.cpp under the largest)")
    parser.add_argument("--timeout", type=float, default=3600)
    parser.add_argument("--only", default="", help="configurations to run, e.g. 'memfit@4,sd.cpp@none' (default: all)")
    parser.add_argument("--add", action="store_true", help="add the rows to docs/NAME.json's (a later run of more "
                        "configurations; its first run is kept)")
    parser.add_argument("--cache-dir")
    parser.add_argument("--build-only", action="store_true")
    parser.add_argument("--name", default="sdcpp_flux")
    parser.add_argument("--child-memfit", help=argparse.SUPPRESS)
    parser.add_argument("--rerender", action="store_true", help="rewrite docs/NAME.md from its JSON (its remarks "
                        "included)")
    args = parser.parse_args()
    if args.child_memfit:
        print("RESULT " + json.dumps(run_memfit_child(json.loads(args.child_memfit))))
        return
    if args.rerender:
        from common import write_outputs

        data = json.loads((Path(__file__).resolve().parent.parent / "docs" / f"{args.name}.json").read_text())
        write_outputs(args.name, data, render(data))
        return
    files = build_files(args.models)
    if args.build_only:
        return
    if not args.sd:
        parser.error("--sd is needed (or --build-only)")
    from common import machine, write_outputs
    from sdcpp import sdcpp_version

    from memfit.testing.cgroup import cgroup_unavailable_reason

    reason = cgroup_unavailable_reason()
    if reason:
        sys.exit(f"cannot run in a memory cgroup here ({reason})")
    caps = [float(cap) for cap in args.caps.split(",")]
    args.cache_dir = args.cache_dir or tempfile.mkdtemp(prefix="sdcpp-flux-cache-")
    images = Path(tempfile.mkdtemp(prefix="sdcpp-flux-images-"))
    earlier = json.loads((Path(__file__).resolve().parent.parent / "docs" / f"{args.name}.json").read_text()) \
        if args.add else None
    first = earlier["first_run"] if earlier else measure(
        "memfit", max(caps), args, files, str(images / "first.png"), f"{PROMPT}, first run", steps=1)
    if not first["completed"]:
        sys.exit(f"memfit's first run did not complete: {first.get('error') or 'killed'}")
    print(f"memfit's first run (1 step, unmeasured): {first['wall_s']:.1f} s", flush=True)
    chosen = [c for c in configurations(caps)
              if not args.only or f"{c[0]}@{'none' if c[1] is None else f'{c[1]:g}'}" in args.only.split(",")]
    rows = earlier["rows"] if earlier else []
    commands = earlier["commands"] if earlier else {}
    start = 1 + max((r["round"] for r in rows), default=-1)
    for round_ in range(start, start + args.rounds):
        for system, cap in chosen if round_ % 2 == 0 else chosen[::-1]:
            where = "uncapped" if cap is None else f"{cap:g} GiB"
            prompt = f"{PROMPT}, take {round_}, {system}, {where}"
            image = str(images / f"{system}-{where.replace(' ', '')}-{round_}.png")
            row = {**measure(system, cap, args, files, image, prompt), "round": round_, "steps": args.steps}
            rows.append(row)
            print(f"round {round_} {label(row)}: " + (f"{row['wall_s']:.1f} s, peak RSS {_gib(row['peak_rss'])}"
                  if row["completed"] else "killed" if row["killed"] else f"failed {row.get('error')}"), flush=True)
            command = " ".join(sys.argv[1:])
            data = {"command": f"{earlier['command']}`, then `python benchmarks/sdcpp_flux.py {command}" if earlier
                    else command, "settings": {k: str(v) if isinstance(v, Path) else v
                                                                     for k, v in vars(args).items()},
                    "machine": machine(), "sdcpp_version": sdcpp_version(args.sd, args.sd_origin),
                    "file_bytes": {str(p): p.stat().st_size for p in files.values()}, "first_run_s": first["wall_s"],
                    "first_run": first, "rows": rows, "summary": summarize(rows),
                    "remarks": earlier.get("remarks", []) if earlier else [],
                    "commands": {**commands, "memfit": memfit_cli(args, files),
                                 "sd.cpp": sdcpp_command(args, files, False, "out.png", PROMPT)}}
            write_outputs(args.name, data, render(data))  # after every run: a run cut short keeps what it finished


if __name__ == "__main__":
    main()
