"""Autoregressive text generation with a KV cache: greedy, or sampled with temperature,
top-k and top-p (nucleus).

One forward pass over the prompt fills the cache (what a layer caches is its attention part's
choice, :meth:`megalite.layers.part_shape.PartShape.cache_buffers`: keys and values of
self-attention, the compressed latent of Multi-head Latent Attention); then each step feeds the one new token
and reads the logits of the last position. Sampling, from the last position's logits z:
    greedy:      argmax z
    temperature: p = softmax(z / T)
    top-k:       keep the k largest z (others -inf)
    top-p:       keep the smallest set of most probable tokens whose probability sums to >= p
and draw from what is left with a seeded generator, so a seed reproduces the text.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from megalite.layers.kv_cache import KVCache
from megalite.parallel import comm


@dataclass
class Sampling:
    greedy: bool = True
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def check(self) -> None:
        if self.temperature <= 0:
            raise ValueError(f"--temperature must be > 0, got {self.temperature} (use --greedy for argmax).")
        if self.top_k < 0:
            raise ValueError(f"--top-k must be >= 0 (0: off), got {self.top_k}.")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"--top-p must be in (0, 1], got {self.top_p}.")


def next_token(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator) -> int:
    """One token id from the last position's logits (vocab,)."""
    if sampling.greedy:
        return int(logits.argmax())
    z = logits.float() / sampling.temperature
    if sampling.top_k > 0:
        kth = torch.topk(z, min(sampling.top_k, z.numel())).values[-1]
        z = z.masked_fill(z < kth, float("-inf"))
    if sampling.top_p < 1:
        sorted_z, order = torch.sort(z, descending=True)
        probs = torch.softmax(sorted_z, dim=-1)
        before = torch.cumsum(probs, dim=-1) - probs  # mass of the more probable tokens
        sorted_z = sorted_z.masked_fill(before >= sampling.top_p, float("-inf"))  # the first always stays
        z = torch.full_like(z, float("-inf")).scatter(0, order, sorted_z)
    probs = torch.softmax(z, dim=-1)
    return int(torch.multinomial(probs.cpu(), 1, generator=generator))


def model_cache(model, batch: int, max_length: int, dtype: torch.dtype, device) -> KVCache:
    """An empty cache for ``model``'s layers, each sized by its attention part's
    ``cache_buffers`` (on this TP rank)."""
    tp = comm.group_size(model.tp_group)
    return KVCache.for_layers({name: layer.attn.cache_buffers(model.cfg, tp) for name, layer in model.layers.items()},
                              batch, max_length, dtype, device)


@torch.no_grad()
def generate(model, prompt: list[int], max_new_tokens: int, sampling: Sampling | None = None,
             eos_ids: tuple[int, ...] = ()) -> list[int]:
    """The new token ids after ``prompt`` (stops after an EOS id or ``max_new_tokens``)."""
    sampling = sampling or Sampling()
    sampling.check()
    if not prompt:
        raise ValueError("the prompt is empty: give at least one token (a BOS token will do).")
    cfg = model.cfg
    length = len(prompt) + max_new_tokens
    if cfg.position_embedding_type == "learned_absolute" and length > cfg.max_position_embeddings:
        raise ValueError(f"prompt ({len(prompt)}) + --max-new-tokens ({max_new_tokens}) = {length} exceeds the "
                         f"model's {cfg.max_position_embeddings} learned positions. Fix: shorten either.")
    param = next(model.parameters())
    model.eval()
    cache = model_cache(model, 1, length, param.dtype, param.device)
    generator = torch.Generator().manual_seed(sampling.seed)
    tokens = torch.tensor([prompt], device=param.device)
    out: list[int] = []
    for _ in range(max_new_tokens):
        logits = model(tokens, kv_cache=cache)[0, -1]
        token = next_token(logits, sampling, generator)
        out.append(token)
        if token in eos_ids:
            break
        tokens = torch.tensor([[token]], device=param.device)
    return out
