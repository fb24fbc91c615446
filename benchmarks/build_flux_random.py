"""Build the FLUX.1-dev architecture with random weights as a diffusers folder, without ever
holding a component in memory.

    python benchmarks/build_flux_random.py /work/bench-models/flux-dev-random            # bf16 files
    python benchmarks/build_flux_random.py /work/bench-models/flux-dev-random-fp16 --dtype fp16
    # the bf16 folder with its transformer stored in fp16, as sparse files of zeros (no disk used):
    python benchmarks/build_flux_random.py /work/bench-models/flux-dev-fp16-sparse \
        --fp16-sparse-of /work/bench-models/flux-dev-random

Each component is built on the ``meta`` device (shapes only, from memfit.models.archs.FLUX: the
exact configs of FLUX.1-dev: 12B transformer, T5-XXL encoder, CLIP-L, 16-channel VAE), and its
tensors are generated one at a time and written into safetensors shards of at most 5 GB with the
index file diffusers and transformers read. Peak memory is one shard, not the model (about 33 GB
of bf16). Tied weights are written once (T5's ``shared``), as save_pretrained does. Memory and
speed do not depend on weight values: weights are N(0, 0.02), norm scales 1, biases 0, so
activations stay finite. Tokenizers are memfit's small offline ones (no hub); T5 runs on 512 tokens
as Flux does (max_sequence_length 512), so its compute is the real one.

The folder is complete once model_index.json exists (written last); a rerun with it present does
nothing. Check free disk first: the script refuses when the disk has less room than the model.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

from memfit.models.archs import get_arch  # noqa: E402

SHARD_BYTES = 5 * 10**9
FLUX_DEV_SCHEDULER = {
    "_class_name": "FlowMatchEulerDiscreteScheduler",
    "base_image_seq_len": 256,
    "base_shift": 0.5,
    "max_image_seq_len": 4096,
    "max_shift": 1.15,
    "num_train_timesteps": 1000,
    "shift": 3.0,
    "use_dynamic_shifting": True,
}


def meta_model(spec):
    with torch.device("meta"):
        if spec.library == "diffusers":
            import diffusers

            return getattr(diffusers, spec.class_name).from_config(dict(spec.config))
        import transformers

        cls = getattr(transformers, spec.class_name)
        return cls(cls.config_class(**dict(spec.config)))


def tensors_to_write(model) -> list[tuple[str, torch.Size]]:
    """(name, shape) of every tensor save_pretrained would write: tied tensors once."""
    seen, out = set(), []
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        out.append((name, tensor.shape))
    return out


def random_tensor(name: str, shape, dtype, generator) -> torch.Tensor:
    if name.endswith("bias"):
        return torch.zeros(shape, dtype=dtype)
    if len(shape) == 1 and "norm" in name:
        return torch.ones(shape, dtype=dtype)
    return (torch.randn(shape, generator=generator, dtype=torch.float32) * 0.02).to(dtype)


def write_component(spec, folder: Path, dtype, generator) -> int:
    from safetensors.torch import save_file

    model = meta_model(spec)
    folder.mkdir(parents=True, exist_ok=True)
    if spec.library == "diffusers":
        model.save_config(folder)
        stem, index_name = "diffusion_pytorch_model", "diffusion_pytorch_model.safetensors.index.json"
    else:
        model.config.torch_dtype = dtype
        model.config.save_pretrained(folder)
        stem, index_name = "model", "model.safetensors.index.json"
    entries = tensors_to_write(model)
    del model
    shards: list[list[tuple[str, torch.Size]]] = [[]]
    size = 0
    element = torch.empty((), dtype=dtype).element_size()
    for name, shape in entries:
        nbytes = element * int(torch.Size(shape).numel())
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append((name, shape))
        size += nbytes
    weight_map, total = {}, 0
    for i, shard in enumerate(shards):
        file = f"{stem}.safetensors" if len(shards) == 1 else f"{stem}-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {name: random_tensor(name, shape, dtype, generator) for name, shape in shard}
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        save_file(tensors, str(folder / file), metadata={"format": "pt"})
        del tensors
        weight_map.update((name, file) for name, _ in shard)
        print(f"  {folder.name}/{file}", flush=True)
    if len(shards) > 1:
        (folder / index_name).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    return total


def expected_bytes(dtype) -> int:
    element = torch.empty((), dtype=dtype).element_size()
    return sum(spec.expected_params for spec in get_arch("flux").components) * element


def build(folder: Path, dtype=torch.bfloat16, seed: int = 0) -> Path:
    if (folder / "model_index.json").is_file():
        print(f"{folder} is complete already (model_index.json present)")
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    need = expected_bytes(dtype)
    free = shutil.disk_usage(folder).free
    if free < need * 1.05:
        raise SystemExit(f"{folder}: the disk has {free / 1e9:.1f} GB free, the model needs {need / 1e9:.1f} GB; "
                         "free some space or pick another folder.")
    print(f"building FLUX.1-dev with random {dtype} weights ({need / 1e9:.1f} GB) at {folder}; "
          f"{free / 1e9:.1f} GB free", flush=True)
    import diffusers

    from memfit.testing import clip_tokenizer, word_tokenizer

    started = time.perf_counter()
    generator = torch.Generator().manual_seed(seed)
    total = 0
    for spec in get_arch("flux").components:
        total += write_component(spec, folder / spec.name, dtype, generator)
    clip_tokenizer(model_max_length=77).save_pretrained(folder / "tokenizer")
    word_tokenizer(model_max_length=512).save_pretrained(folder / "tokenizer_2")
    diffusers.FlowMatchEulerDiscreteScheduler.from_config(FLUX_DEV_SCHEDULER).save_pretrained(folder / "scheduler")
    index = {
        "_class_name": "FluxPipeline",
        "_diffusers_version": diffusers.__version__,
        "feature_extractor": [None, None],
        "image_encoder": [None, None],
        "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
        "text_encoder": ["transformers", "CLIPTextModel"],
        "text_encoder_2": ["transformers", "T5EncoderModel"],
        "tokenizer": ["transformers", "CLIPTokenizer"],
        "tokenizer_2": ["transformers", "PreTrainedTokenizerFast"],
        "transformer": ["diffusers", "FluxTransformer2DModel"],
        "vae": ["diffusers", "AutoencoderKL"],
    }
    (folder / "model_index.json").write_text(json.dumps(index, indent=2) + "\n")  # last: marks the folder complete
    print(f"built {folder} ({total / 1e9:.1f} GB) in {time.perf_counter() - started:.0f} s", flush=True)
    return folder


def build_fp16_sparse(folder: Path, source: Path) -> Path:
    """``source`` (a built bf16 folder) with its transformer stored in fp16: every other component is a
    link to ``source``'s, and the transformer's shards are safetensors files of the same shapes whose
    data is a hole (zeros, no disk blocks). For memory figures of an fp16 checkpoint run in bf16 (the
    conversion happens whatever the values) where the disk has no room for 23.8 GB more; reading a
    hole never reaches the disk, so times measured on it are not disk-bound."""
    import struct

    from memfit.safetensors_header import read_header

    if (folder / "model_index.json").is_file():
        print(f"{folder} is complete already (model_index.json present)")
        return folder
    if not (source / "model_index.json").is_file():
        raise SystemExit(f"{source} is not built; build it first (see this script's docstring)")
    folder.mkdir(parents=True, exist_ok=True)
    for part in sorted(source.iterdir()):
        if part.is_dir() and part.name != "transformer" and not (folder / part.name).exists():
            (folder / part.name).symlink_to(part.resolve(), target_is_directory=True)
    transformer = folder / "transformer"
    transformer.mkdir(exist_ok=True)
    for file in sorted((source / "transformer").iterdir()):
        if file.suffix != ".safetensors":
            shutil.copyfile(file, transformer / file.name)  # config.json, the shard index
            continue
        header = read_header(file)
        entries = {key: dict(entry, dtype="F16") for key, entry in header.entries.items()}  # bf16 and fp16: 2 bytes
        text = json.dumps({"__metadata__": header.metadata, **entries}, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)
        with (transformer / file.name).open("wb") as out:
            out.write(struct.pack("<Q", len(text)) + text)
            out.truncate(8 + len(text) + header.data_end - header.data_start)
        print(f"  {transformer.name}/{file.name} (sparse, fp16)", flush=True)
    shutil.copyfile(source / "model_index.json", folder / "model_index.json")  # last: marks the folder complete
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder")
    parser.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    parser.add_argument("--fp16-sparse-of", metavar="BF16_FOLDER",
                        help="instead: link BF16_FOLDER's components and store its transformer in fp16, sparse")
    args = parser.parse_args()
    if args.fp16_sparse_of:
        build_fp16_sparse(Path(args.folder), Path(args.fp16_sparse_of))
        return
    build(Path(args.folder), torch.bfloat16 if args.dtype == "bf16" else torch.float16)


if __name__ == "__main__":
    main()
