"""Activation-bounded denoiser: a UNet's attention and feed-forward layers run over chunks of tokens.

Why: in a UNet's transformer blocks the widest tensors are per-token: the query, the attention
output and its projection (tokens x inner width each), and above all the GEGLU feed-forward's
hidden layer (tokens x 8 x channels, then x 4). At 512x512 the first down block has 4096 tokens, so
these are the largest activations of a denoiser pass, several times the block's input.

How: the key and value are computed once from the whole context (self-attention's context is the
hidden states themselves; cross-attention's is the text), then the query, scaled dot-product
attention and output projection run ``chunk`` query tokens at a time into one output tensor. Each
chunk's softmax is over all keys, so no approximation is made: every output token is computed from
exactly the inputs it has in the whole-tensor call. The feed-forward, which is per token, runs over
the same chunks. What remains at full size is a block's input and output, not its hidden layers.

Exactness: the arithmetic per token is the same; what can differ is the matrix-multiply and
attention kernels' blocking for a chunk of rows versus all rows (another summation order). Results
agree within float rounding (tested against plain diffusers in tests/test_chunked_attention.py).

Scope: attention layers whose processor is diffusers' AttnProcessor2_0 (the default of SD 1.5 and
SDXL UNets) on token sequences without a mask, group norm or spatial norm; any other call goes to
the layer's own processor unchanged. ``enable_chunked_attention`` installs it;
``disable_chunked_attention`` restores the processors and feed-forwards exactly as they were.
"""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.nn.functional as F

__all__ = ["DEFAULT_CHUNK_BYTES", "chunked_attention", "disable_chunked_attention", "enable_chunked_attention",
           "is_chunked", "tokens_per_chunk"]

# The widest per-chunk temporary (a feed-forward's hidden layer): small against the full-size ones.
DEFAULT_CHUNK_BYTES = 8 * 2**20
_MARK = "_memfit_chunked"


def tokens_per_chunk(width: int, element_size: int, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> int:
    """Tokens per chunk so a chunk's widest temporary, a GEGLU hidden layer (8 x ``width``), stays
    under ``chunk_bytes``."""
    return max(1, chunk_bytes // max(1, 8 * width * element_size))


class ChunkedAttnProcessor:
    """AttnProcessor2_0's computation over chunks of query tokens; other calls go to ``inner``."""

    def __init__(self, inner, chunk_bytes: int = DEFAULT_CHUNK_BYTES):
        self.inner = inner
        self.chunk_bytes = chunk_bytes

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, temb=None,
                 *args, **kwargs):
        if (args or kwargs or attention_mask is not None or hidden_states.ndim != 3 or attn.spatial_norm is not None
                or attn.group_norm is not None or torch.is_grad_enabled()):
            return self.inner(attn, hidden_states, encoder_hidden_states, attention_mask, temb, *args, **kwargs)
        batch, tokens, width = hidden_states.shape
        context = hidden_states if encoder_hidden_states is None else encoder_hidden_states
        if encoder_hidden_states is not None and attn.norm_cross:
            context = attn.norm_encoder_hidden_states(context)
        key = attn.to_k(context)
        value = attn.to_v(context)
        inner_dim = key.shape[-1]
        head_dim = inner_dim // attn.heads
        key = key.view(batch, -1, attn.heads, head_dim).transpose(1, 2)
        value = value.view(batch, -1, attn.heads, head_dim).transpose(1, 2)
        if attn.norm_k is not None:
            key = attn.norm_k(key)
        step = tokens_per_chunk(max(width, inner_dim), hidden_states.element_size(), self.chunk_bytes)
        out = None
        for t0 in range(0, tokens, step):
            part = hidden_states[:, t0:t0 + step]
            query = attn.to_q(part).view(batch, -1, attn.heads, head_dim).transpose(1, 2)
            if attn.norm_q is not None:
                query = attn.norm_q(query)
            attended = F.scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0,
                                                      is_causal=False)
            attended = attended.transpose(1, 2).reshape(batch, -1, attn.heads * head_dim).to(query.dtype)
            projected = attn.to_out[1](attn.to_out[0](attended))
            if attn.residual_connection:
                projected = projected + part
            projected = projected / attn.rescale_output_factor
            if out is None:
                out = projected.new_empty((batch, tokens, projected.shape[-1]))
            out[:, t0:t0 + step] = projected
        return out


def _feed_forward_in_chunks(ff, chunk_bytes, hidden_states, *args, **kwargs):
    if args or kwargs or hidden_states.ndim != 3 or torch.is_grad_enabled():
        return type(ff).forward(ff, hidden_states, *args, **kwargs)
    batch, tokens, width = hidden_states.shape
    step = tokens_per_chunk(width, hidden_states.element_size(), chunk_bytes)
    if step >= tokens:
        return type(ff).forward(ff, hidden_states)
    out = None
    for t0 in range(0, tokens, step):
        part = type(ff).forward(ff, hidden_states[:, t0:t0 + step])
        if out is None:
            out = part.new_empty((batch, tokens, part.shape[-1]))
        out[:, t0:t0 + step] = part
    return out


def enable_chunked_attention(denoiser: torch.nn.Module, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> int:
    """Run ``denoiser``'s AttnProcessor2_0 attention layers and their blocks' feed-forwards in
    chunks of tokens; returns how many attention layers it changed (0: nothing to bound)."""
    from diffusers.models.attention import FeedForward
    from diffusers.models.attention_processor import Attention, AttnProcessor2_0

    changed = 0
    for module in denoiser.modules():
        if _MARK in module.__dict__:
            continue
        if isinstance(module, Attention) and type(module.processor) is AttnProcessor2_0:
            module.__dict__[_MARK] = module.processor
            module.set_processor(ChunkedAttnProcessor(module.processor, chunk_bytes))
            changed += 1
        elif isinstance(module, FeedForward):
            module.__dict__[_MARK] = True
            # An instance-level forward: the module is still entered through __call__, so the weight
            # streaming hooks memfit puts on it (memfit.run.offload) fire as before.
            module.forward = functools.partial(_feed_forward_in_chunks, module, chunk_bytes)
    return changed


def disable_chunked_attention(denoiser: torch.nn.Module) -> None:
    """Undo enable_chunked_attention: every processor and feed-forward as it was."""
    for module in denoiser.modules():
        original = module.__dict__.pop(_MARK, None)
        if original is None:
            continue
        if original is True:
            module.__dict__.pop("forward", None)
        else:
            module.set_processor(original)


def is_chunked(denoiser: torch.nn.Module) -> bool:
    return any(_MARK in module.__dict__ for module in denoiser.modules())


@contextlib.contextmanager
def chunked_attention(denoiser: torch.nn.Module | None, chunk_bytes: int = DEFAULT_CHUNK_BYTES):
    """While inside, ``denoiser`` runs its attention and feed-forwards in chunks of tokens."""
    if denoiser is None:
        yield
        return
    enable_chunked_attention(denoiser, chunk_bytes)
    try:
        yield
    finally:
        disable_chunked_attention(denoiser)
