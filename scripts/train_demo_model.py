#!/usr/bin/env python
"""Train memfit's built-in demo model: a tiny Stable Diffusion pipeline on coloured shapes.

    python scripts/train_demo_model.py                 # full run, ~30 min on 2 CPU cores
    python scripts/train_demo_model.py --quick --out /tmp/demo   # smoke run, ~1 min
    python scripts/train_demo_model.py --resume-from /tmp/demo_base --steps 1100 --out /tmp/demo_ft
        # fine-tune an existing model: VAE frozen, UNet + text encoder trained further (~20-25 min)

Phases (each timed):
1. data: render the synthetic shapes data set (memfit.demo.shapes), training combos only;
2. vae: train a small AutoencoderKL (64x64x3 <-> 16x16x4) on those images, then set its
   scaling_factor so the scaled latents have unit standard deviation;
3. diffusion: encode the images once, then train a CLIPTextModel (from scratch) jointly with a
   UNet2DConditionModel as a latent diffusion model (v-prediction, zero-terminal-SNR schedule,
   10% empty captions so classifier-free guidance works), keeping an EMA of both;
4. save: a StableDiffusionPipeline with a DDIMScheduler of the same noise schedule, written with
   save_pretrained(safe_serialization=True), plus memfit_defaults.json.

Deterministic from --seed (same seed, same thread count -> same weights). Offline: nothing is
loaded from a hub.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import pathlib
import random
import shutil
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("DIFFUSERS_VERBOSITY", "error")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from tqdm import tqdm  # noqa: E402

from memfit.demo import shapes  # noqa: E402
from memfit.testing.tokenizers import clip_tokenizer  # noqa: E402

MAX_TOKENS = 16
DEFAULT_OUT = ROOT / "src" / "memfit" / "demo" / "model"

# The noise schedule used for training; the shipped DDIMScheduler gets the same one.
SCHEDULE = dict(
    num_train_timesteps=1000,
    beta_start=0.00085,
    beta_end=0.012,
    beta_schedule="scaled_linear",
    prediction_type="v_prediction",
    rescale_betas_zero_snr=True,
    clip_sample=False,
)

# Sized for ~25 min on 2 shared CPU cores (one torch thread: ~0.5 s per VAE step of 16 images,
# ~1.2 s per diffusion step of 64 latents. Tried: 1700 steps of 32 latents, worse on shape).
FULL = dict(
    vae_images=4096, vae_steps=1100, vae_batch=8, vae_lr=2e-3,
    images=8000, two_shape_fraction=0.1, steps=950, batch=64, lr=1e-3, warmup=50,
    ema_decay=0.995,
)
# Fine-tuning an existing model (--resume-from): its VAE is loaded frozen (latent scale kept), its
# UNet and text encoder continue training on freshly drawn images (a different data seed), from a
# short warmup to a cosine decay. Checkpoints of the EMA weights can be written on the way.
FINETUNE = dict(
    images=8000, two_shape_fraction=0.1, steps=800, batch=64, lr=5e-4, warmup=20,
    ema_decay=0.995, data_seed_offset=100,
)
QUICK = dict(
    vae_images=256, vae_steps=20, vae_batch=16, vae_lr=2e-3,
    images=512, two_shape_fraction=0.1, steps=30, batch=64, lr=1e-3, warmup=10,
    ema_decay=0.9,
)
DEFAULTS = {"steps": 25, "guidance": 4.0, "width": 64, "height": 64}


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.use_deterministic_algorithms(True)


def build_vae():
    from diffusers import AutoencoderKL

    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 3,
        up_block_types=("UpDecoderBlock2D",) * 3,
        block_out_channels=(16, 32, 64),
        layers_per_block=1,
        latent_channels=4,
        # One group: GroupNorm with one channel per group is instance norm, which maps every flat
        # colour to the same zeros; the decoder could then not paint a plain background.
        norm_num_groups=1,
        sample_size=64,
    )


def build_text_encoder(vocab_size: int, tokenizer):
    from transformers import CLIPTextConfig, CLIPTextModel

    config = CLIPTextConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=256,
        num_hidden_layers=3,
        num_attention_heads=4,
        max_position_embeddings=MAX_TOKENS,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return CLIPTextModel(config)


def build_unet():
    from diffusers import UNet2DConditionModel

    return UNet2DConditionModel(
        sample_size=16,
        in_channels=4,
        out_channels=4,
        layers_per_block=1,
        # Attention only at 8x8 and 4x4 (and the mid block): 16x16 self-attention costs more on a
        # CPU than it brings for flat shapes.
        block_out_channels=(48, 96, 96),
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
        cross_attention_dim=64,
        attention_head_dim=4,
        norm_num_groups=8,  # 6-12 channels per group, so flat colours survive normalisation
    )


def to_tensor(images: np.ndarray) -> torch.Tensor:
    """uint8 (n, h, w, 3) -> float (n, 3, h, w) in [-1, 1]."""
    return torch.from_numpy(images).permute(0, 3, 1, 2).float().div(127.5).sub(1.0)


def lr_at(step: int, total: int, base: float, warmup: int) -> float:
    if step < warmup:
        return base * (step + 1) / warmup
    progress = (step - warmup) / max(total - warmup, 1)
    return base * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * progress)))


def train_vae(cfg: dict, seed: int):
    images, _, _ = shapes.make_dataset(cfg["vae_images"], seed + 1, two_shape_fraction=0.3)
    data = to_tensor(images)
    vae = build_vae()
    vae.train()
    opt = torch.optim.AdamW(vae.parameters(), lr=cfg["vae_lr"], weight_decay=0.0)
    gen = torch.Generator().manual_seed(seed + 2)
    bar = tqdm(range(cfg["vae_steps"]), desc="vae", dynamic_ncols=True, mininterval=2)
    for step in bar:
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg["vae_steps"], cfg["vae_lr"], 20)
        idx = torch.randint(0, len(data), (cfg["vae_batch"],), generator=gen)
        x = data[idx]
        posterior = vae.encode(x).latent_dist
        z = posterior.mean + posterior.std * torch.randn(posterior.mean.shape, generator=gen)
        recon = vae.decode(z).sample
        mse = F.mse_loss(recon, x)
        kl = posterior.kl().mean() / z[0].numel()
        loss = mse + 1e-4 * kl
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(vae.parameters(), 1.0)
        opt.step()
        if step % 10 == 0:
            bar.set_postfix(mse=f"{mse.item():.5f}", kl=f"{kl.item():.3f}")
    vae.eval()
    with torch.no_grad():
        held, _, _ = shapes.make_dataset(64, seed + 5, combos=shapes.held_out_combos())
        x = to_tensor(held)
        mse = F.mse_loss(vae.decode(vae.encode(x).latent_dist.mean).sample, x).item()
    print(f"vae reconstruction mse on held-out combos: {mse:.5f}", flush=True)
    return vae


@torch.no_grad()
def encode_all(vae, images: np.ndarray, batch: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    means, stds = [], []
    for start in tqdm(range(0, len(images), batch), desc="encode", dynamic_ncols=True, mininterval=2):
        dist = vae.encode(to_tensor(images[start : start + batch])).latent_dist
        means.append(dist.mean)
        stds.append(dist.std)
    return torch.cat(means), torch.cat(stds)


class EMA:
    def __init__(self, modules, decay: float):
        self.decay = decay
        self.params = [p for m in modules for p in m.parameters()]
        self.shadow = [p.detach().clone() for p in self.params]

    @torch.no_grad()
    def update(self, step: int):
        decay = min(self.decay, (1 + step) / (10 + step))
        torch._foreach_lerp_(self.shadow, [p.detach() for p in self.params], 1 - decay)

    @torch.no_grad()
    def copy_to(self):
        for p, s in zip(self.params, self.shadow):
            p.copy_(s)


def train_diffusion(cfg: dict, seed: int, vae, tokenizer, init=None, checkpoint=None):
    """Train (or with init=(text_encoder, unet), continue training) the text encoder and UNet.

    checkpoint: optional (every_n_steps, callback(step, text_encoder, unet)) called with copies of
    the models holding the EMA weights.
    """
    from diffusers import DDPMScheduler

    data_seed = seed + 3 + cfg.get("data_seed_offset", 0)
    images, captions, _ = shapes.make_dataset(cfg["images"], data_seed, two_shape_fraction=cfg["two_shape_fraction"])
    means, stds = encode_all(vae, images)
    if init is None:
        scale = float(1.0 / means.std())
        vae.register_to_config(scaling_factor=scale)
        print(f"latent std {means.std():.4f} -> scaling_factor {scale:.4f}", flush=True)
    else:
        scale = float(vae.config.scaling_factor)
        print(f"latent std {means.std():.4f}; keeping the loaded scaling_factor {scale:.4f}", flush=True)

    ids = tokenizer(captions, padding="max_length", max_length=MAX_TOKENS, truncation=True, return_tensors="pt").input_ids
    empty = tokenizer([""], padding="max_length", max_length=MAX_TOKENS, return_tensors="pt").input_ids[0]

    if init is None:
        text_encoder = build_text_encoder(len(tokenizer), tokenizer)
        unet = build_unet()
    else:
        text_encoder, unet = init
    n_unet = sum(p.numel() for p in unet.parameters())
    n_text = sum(p.numel() for p in text_encoder.parameters())
    print(f"unet {n_unet / 1e6:.2f}M params, text encoder {n_text / 1e6:.2f}M params", flush=True)
    text_encoder.train()
    unet.train()
    params = list(unet.parameters()) + list(text_encoder.parameters())
    opt = torch.optim.AdamW(params, lr=cfg["lr"], weight_decay=0.01)
    ema = EMA([unet, text_encoder], cfg["ema_decay"])
    noise_scheduler = DDPMScheduler(**SCHEDULE)
    alphas_cumprod = noise_scheduler.alphas_cumprod
    gen = torch.Generator().manual_seed(seed + 4)

    bar = tqdm(range(cfg["steps"]), desc="diffusion", dynamic_ncols=True, mininterval=2)
    running = None
    for step in bar:
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg["steps"], cfg["lr"], cfg["warmup"])
        idx = torch.randint(0, len(means), (cfg["batch"],), generator=gen)
        latents = (means[idx] + stds[idx] * torch.randn(means[idx].shape, generator=gen)) * scale
        batch_ids = ids[idx].clone()
        drop = torch.rand(len(idx), generator=gen) < 0.1
        batch_ids[drop] = empty
        noise = torch.randn(latents.shape, generator=gen)
        t = torch.randint(0, SCHEDULE["num_train_timesteps"], (len(idx),), generator=gen)
        noisy = noise_scheduler.add_noise(latents, noise, t)
        target = noise_scheduler.get_velocity(latents, noise, t)
        hidden = text_encoder(batch_ids)[0]
        pred = unet(noisy, t, encoder_hidden_states=hidden).sample
        loss = F.mse_loss(pred, target)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        ema.update(step)
        running = loss.item() if running is None else 0.98 * running + 0.02 * loss.item()
        if step % 10 == 0:
            bar.set_postfix(loss=f"{running:.4f}", lr=f"{opt.param_groups[0]['lr']:.1e}")
        if checkpoint is not None and (step + 1) % checkpoint[0] == 0 and step + 1 < cfg["steps"]:
            te_copy, unet_copy = copy.deepcopy(text_encoder), copy.deepcopy(unet)
            # ema.params is [unet..., text_encoder...]; map shadows onto the copies in that order
            with torch.no_grad():
                for p, sh in zip(list(unet_copy.parameters()) + list(te_copy.parameters()), ema.shadow):
                    p.copy_(sh)
            te_copy.eval()
            unet_copy.eval()
            checkpoint[1](step + 1, te_copy, unet_copy)
            print(f"checkpoint at step {step + 1} (loss {running:.4f})", flush=True)
    del alphas_cumprod
    ema.copy_to()
    unet.eval()
    text_encoder.eval()
    return text_encoder, unet


def folder_size(path: pathlib.Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def save_pipeline(out: pathlib.Path, vae, text_encoder, tokenizer, unet, training: dict) -> int:
    """Write a StableDiffusionPipeline (+ memfit_defaults.json, training.json) to out atomically."""
    from diffusers import DDIMScheduler, StableDiffusionPipeline

    scheduler = DDIMScheduler(**SCHEDULE, timestep_spacing="trailing", set_alpha_to_one=False)
    pipe = StableDiffusionPipeline(
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        unet=unet,
        scheduler=scheduler,
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )
    out = out.resolve()
    tmp = out.with_name(out.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    pipe.save_pretrained(tmp, safe_serialization=True)
    for config in tmp.glob("*/config.json"):  # a loaded (--resume-from) model records where it came from
        data = json.loads(config.read_text())
        if data.pop("_name_or_path", None) is not None:
            config.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    (tmp / "memfit_defaults.json").write_text(json.dumps(DEFAULTS, indent=2) + "\n")
    (tmp / "training.json").write_text(json.dumps(training, indent=2) + "\n")
    for path in tmp.rglob("*"):  # safetensors are written 0600; package data must be readable by all
        path.chmod(0o755 if path.is_dir() else 0o644)
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    return folder_size(out)


def load_parts(model: pathlib.Path):
    """The VAE (frozen), text encoder, UNet and training.json of an existing demo model folder."""
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from transformers import CLIPTextModel

    vae = AutoencoderKL.from_pretrained(model / "vae")
    vae.requires_grad_(False)
    vae.eval()
    text_encoder = CLIPTextModel.from_pretrained(model / "text_encoder")
    unet = UNet2DConditionModel.from_pretrained(model / "unet")
    path = model / "training.json"
    previous = json.loads(path.read_text()) if path.is_file() else {}
    return vae, text_encoder, unet, previous


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=pathlib.Path, default=DEFAULT_OUT)
    parser.add_argument("--quick", action="store_true", help="a smoke run of about a minute (useless weights)")
    parser.add_argument(
        "--resume-from",
        type=pathlib.Path,
        default=None,
        help="fine-tune this demo model folder: keep its VAE (frozen), continue training its UNet and "
        "text encoder (FINETUNE config; --steps/--lr override)",
    )
    parser.add_argument("--steps", type=int, default=None, help="diffusion steps (override)")
    parser.add_argument("--lr", type=float, default=None, help="peak diffusion learning rate (override)")
    parser.add_argument("--save-every", type=int, default=0, help="also save EMA checkpoints to OUT-stepN every N steps")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (default 1: on a small shared machine, two OpenMP threads fighting other "
        "processes for two cores ran 2-10x slower than one)",
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.resume_from is not None:
        cfg = dict(FINETUNE)
        if args.quick:
            cfg.update(images=512, steps=10, warmup=2)
    else:
        cfg = dict(QUICK if args.quick else FULL)
    if args.steps is not None:
        cfg["steps"] = args.steps
    if args.lr is not None:
        cfg["lr"] = args.lr
    seed_everything(args.seed)

    times = {}
    start = time.perf_counter()
    tokenizer = clip_tokenizer(shapes.vocabulary(), model_max_length=MAX_TOKENS)
    out = args.out.resolve()

    previous = None
    init = None
    if args.resume_from is not None:
        if args.resume_from.resolve() == out:
            parser.error("--out must differ from --resume-from")
        vae, text_encoder, unet, previous = load_parts(args.resume_from)
        init = (text_encoder, unet)
        print(f"fine-tuning {args.resume_from} (VAE frozen)", flush=True)
    else:
        t0 = time.perf_counter()
        vae = train_vae(cfg, args.seed)
        times["vae"] = time.perf_counter() - t0
        print(f"[time] vae {times['vae']:.0f}s", flush=True)

    def training_record(step_count: int, elapsed: dict) -> dict:
        record = {
            "seed": args.seed,
            "quick": args.quick,
            "config": cfg | {"steps": step_count},
            "threads": torch.get_num_threads(),
            "seconds": {k: round(v, 1) for k, v in elapsed.items()},
            "torch": torch.__version__,
        }
        if previous is not None:
            prev_secs = previous.get("seconds", {})
            record = {
                "fine_tuned_from": previous,
                "fine_tune": record,
                "seconds": {
                    "vae": prev_secs.get("vae"),
                    "diffusion": round(prev_secs.get("diffusion", 0) + elapsed.get("diffusion", 0), 1),
                    "total": round(prev_secs.get("total", 0) + elapsed.get("total", 0), 1),
                },
                "seed": previous.get("seed"),
            }
        return record

    checkpoint = None
    if args.save_every:
        t_start = time.perf_counter()

        def save_checkpoint(step, te, un):
            elapsed = time.perf_counter() - t_start
            ck = out.with_name(f"{out.name}-step{step}")
            save_pipeline(ck, vae, te, tokenizer, un, training_record(step, {"diffusion": elapsed, "total": elapsed}))

        checkpoint = (args.save_every, save_checkpoint)

    t0 = time.perf_counter()
    text_encoder, unet = train_diffusion(cfg, args.seed, vae, tokenizer, init=init, checkpoint=checkpoint)
    times["diffusion"] = time.perf_counter() - t0
    print(f"[time] diffusion (incl. data + encoding) {times['diffusion']:.0f}s", flush=True)

    t0 = time.perf_counter()
    total = time.perf_counter() - start
    size = save_pipeline(out, vae, text_encoder, tokenizer, unet, training_record(cfg["steps"], times | {"total": total}))
    times["save"] = time.perf_counter() - t0
    print(f"[time] save {times['save']:.1f}s", flush=True)
    print(f"[time] total {total / 60:.1f} min ({total:.0f}s)", flush=True)
    print(f"saved {out} ({size / 2**20:.2f} MiB)", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
