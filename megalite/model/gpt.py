"""A GPT decoder that reads as serial code.

Default architecture is exactly GPT-2: learned absolute positions, pre-LayerNorm blocks,
a GELU MLP of 4h, input and output embeddings tied, biases everywhere. Options give the
Llama-style variant: rotary positions, RMSNorm, SwiGLU, grouped-query attention and an
untied output layer.

Weight layout (what a checkpoint or a tensor-parallel shard refers to):
- ``qkv.weight`` has ``groups * (heads_per_group + 2) * head_dim`` rows ordered by
  key/value group: the group's query heads, then its key head, then its value head.
  Splitting the rows into TP contiguous chunks therefore gives each rank whole groups.
- SwiGLU keeps the gate and up projections as two matrices (``gate``, ``up``).
- Layers are named by their *global* index (``layers.7``) whatever pipeline stage
  holds them, so names do not depend on the layout.

Initialization is GPT-2's (N(0, 0.02), output projections of each residual branch
scaled by 1/sqrt(2 * layers), biases 0, norms 1), drawn per parameter from
``(seed, name)`` in full and then sliced: see ``megalite.parallel.random``.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from megalite.config import ModelConfig
from megalite.layers.attention import attention
from megalite.layers.norms import build_norm
from megalite.layers.rotary import apply_rotary, rotary_angles
from megalite.parallel.random import get_rng_tracker, init_full_tensor


class SelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.heads_per_group = cfg.num_attention_heads // cfg.num_query_groups
        qkv_out = cfg.num_query_groups * (self.heads_per_group + 2) * cfg.head_dim
        self.qkv = nn.Linear(cfg.hidden_size, qkv_out, bias=cfg.add_bias_linear)
        self.proj = nn.Linear(cfg.num_attention_heads * cfg.head_dim, cfg.hidden_size,
                              bias=cfg.add_bias_linear)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        b, s, _ = x.shape
        d, hpg = self.cfg.head_dim, self.heads_per_group
        qkv = self.qkv(x).view(b, s, -1, hpg + 2, d)  # (b, s, groups, hpg + 2, d)
        q = qkv[:, :, :, :hpg].reshape(b, s, -1, d).transpose(1, 2)  # (b, heads, s, d)
        k = qkv[:, :, :, hpg].transpose(1, 2)  # (b, groups, s, d)
        v = qkv[:, :, :, hpg + 1].transpose(1, 2)
        if rope is not None:
            q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
        dropout_p = self.cfg.attention_dropout if self.training else 0.0
        if dropout_p > 0:
            # Attention probabilities belong to this rank's heads: a TP-split tensor.
            with get_rng_tracker().fork():
                out = attention(q, k, v, causal=True, dropout_p=dropout_p,
                                backend=self.cfg.attention_backend)
        else:
            out = attention(q, k, v, causal=True, backend=self.cfg.attention_backend)
        return self.proj(out.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.swiglu = cfg.swiglu
        if cfg.swiglu:
            self.gate = nn.Linear(cfg.hidden_size, cfg.ffn_hidden_size, bias=cfg.add_bias_linear)
            self.up = nn.Linear(cfg.hidden_size, cfg.ffn_hidden_size, bias=cfg.add_bias_linear)
        else:
            self.fc1 = nn.Linear(cfg.hidden_size, cfg.ffn_hidden_size, bias=cfg.add_bias_linear)
        self.fc2 = nn.Linear(cfg.ffn_hidden_size, cfg.hidden_size, bias=cfg.add_bias_linear)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.swiglu:
            h = F.silu(self.gate(x)) * self.up(x)
        else:
            h = F.gelu(self.fc1(x), approximate="tanh")  # GPT-2's gelu_new
        return self.fc2(h)


class TransformerBlock(nn.Module):
    """x + attn(norm(x)), then + mlp(norm(.)); dropout on each branch output."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attn_norm = build_norm(cfg.normalization, cfg.hidden_size, cfg.norm_epsilon)
        self.attn = SelfAttention(cfg)
        self.mlp_norm = build_norm(cfg.normalization, cfg.hidden_size, cfg.norm_epsilon)
        self.mlp = MLP(cfg)
        self.dropout = nn.Dropout(cfg.hidden_dropout)

    def forward(self, x: torch.Tensor, rope=None) -> torch.Tensor:
        x = x + self.dropout(self.attn(self.attn_norm(x), rope))
        return x + self.dropout(self.mlp(self.mlp_norm(x)))


class GPTModel(nn.Module):
    """GPT over the layers ``layer_range`` (all by default).

    ``pre_process``: this module embeds tokens (first pipeline stage).
    ``post_process``: this module applies the final norm, output layer and loss (last stage).
    ``forward`` returns per-token losses (b, s) when labels are given, else logits over
    the real (unpadded) vocabulary; a middle stage returns hidden states.
    """

    def __init__(self, cfg: ModelConfig, padded_vocab_size: int | None = None,
                 pre_process: bool = True, post_process: bool = True,
                 layer_range: range | None = None):
        super().__init__()
        self.cfg = cfg
        self.pre_process, self.post_process = pre_process, post_process
        self.vocab_size = cfg.vocab_size
        self.padded_vocab_size = padded_vocab_size or cfg.padded_vocab_size(1)
        self.layer_range = layer_range if layer_range is not None else range(cfg.num_layers)
        if pre_process:
            self.word_embeddings = nn.Embedding(self.padded_vocab_size, cfg.hidden_size)
            if cfg.position_embedding_type == "learned_absolute":
                self.position_embeddings = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)
            self.embedding_dropout = nn.Dropout(cfg.hidden_dropout)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(cfg) for i in self.layer_range})
        if post_process:
            self.final_norm = build_norm(cfg.normalization, cfg.hidden_size, cfg.norm_epsilon)
            if cfg.untie_embeddings_and_output_weights:
                self.output_layer = nn.Linear(cfg.hidden_size, self.padded_vocab_size, bias=False)
            elif not pre_process:
                # Tied weights on a last stage that does not embed: it holds its own copy,
                # kept equal to the first stage's by the embedding-group all-reduce.
                self.word_embeddings = nn.Embedding(self.padded_vocab_size, cfg.hidden_size)

    # -- forward ---------------------------------------------------------------------------------
    def output_weight(self) -> torch.Tensor:
        if self.cfg.untie_embeddings_and_output_weights:
            return self.output_layer.weight
        return self.word_embeddings.weight

    def embed(self, tokens: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        x = self.word_embeddings(tokens)
        if self.cfg.position_embedding_type == "learned_absolute":
            x = x + self.position_embeddings(position_ids)
        return self.embedding_dropout(x)

    def forward(self, tokens: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                labels: torch.Tensor | None = None, hidden: torch.Tensor | None = None):
        ref = tokens if tokens is not None else labels
        if position_ids is None and ref is not None:
            position_ids = torch.arange(ref.shape[1], device=ref.device).expand_as(ref)
        x = self.embed(tokens, position_ids) if self.pre_process else hidden
        rope = None
        if self.cfg.position_embedding_type == "rope":
            rope = rotary_angles(position_ids, self.cfg.head_dim, self.cfg.rotary_base)
        for layer in self.layers.values():
            x = layer(x, rope)
        if not self.post_process:
            return x
        logits = F.linear(self.final_norm(x), self.output_weight())[..., : self.vocab_size]
        if labels is None:
            return logits
        # Padding columns are never predicted: they were sliced off above.
        return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(),
                               reduction="none").view_as(labels)

    # -- initialization --------------------------------------------------------------------------
    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """GPT-2 init, reproducible per parameter from (seed, global name), layout-independent."""
        std = self.cfg.init_method_std
        output_std = std / math.sqrt(2.0 * self.cfg.num_layers)
        for name, param in self.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            full_shape = getattr(param, "full_shape", tuple(param.shape))
            if "norm" in name:
                full = torch.ones(full_shape) if leaf == "weight" else torch.zeros(full_shape)
            elif leaf == "bias":
                full = torch.zeros(full_shape)
            elif name in ("word_embeddings.weight", "output_layer.weight"):
                # Real rows from the seed, padding rows zero: independent of the padding
                # (which grows with TP). Tied copies on two stages share the name.
                real = init_full_tensor((self.vocab_size, full_shape[1]), seed,
                                        "word_embeddings.weight" if name.startswith("word") else name, std)
                full = torch.cat([real, torch.zeros(full_shape[0] - self.vocab_size, full_shape[1])])
            elif name.endswith("attn.proj.weight") or name.endswith("mlp.fc2.weight"):
                full = init_full_tensor(full_shape, seed, name, output_std)
            else:
                full = init_full_tensor(full_shape, seed, name, std)
            shard = param.shard_fn(full) if hasattr(param, "shard_fn") else full
            param.copy_(shard)


def count_parameters(cfg: ModelConfig) -> int:
    """Parameters of the full model (tied embedding counted once, real vocabulary)."""
    with torch.device("meta"):
        model = GPTModel(cfg, padded_vocab_size=cfg.vocab_size)
    return sum(p.numel() for p in model.parameters())
