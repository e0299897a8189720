"""A GPT decoder that reads as serial code.

Default architecture is exactly GPT-2: learned absolute positions, pre-LayerNorm blocks,
a GELU MLP of 4h, input and output embeddings tied, biases everywhere. Options give the
Llama-style variant: rotary positions, RMSNorm, SwiGLU, grouped-query attention and an
untied output layer.

Weight layout (what a checkpoint or a tensor-parallel shard refers to):
- ``qkv.weight`` has ``groups * (heads_per_group + 2) * head_dim`` rows ordered by
  key/value group: the group's query heads, then its key head, then its value head.
  Splitting the rows into TP contiguous chunks therefore gives each rank whole groups.
- SwiGLU fuses the gate and up projections into ``fc1.weight`` = [gate; up]; under TP each
  rank holds its chunk of each half (``TPSplit(0, sections=2)``).
- Layers are named by their *global* index (``layers.7``) whatever pipeline stage
  holds them, so names do not depend on the layout.

Each block's parts (its attention, dense or MoE MLP, and local or transformer-engine linears)
come from the layer spec, :func:`megalite.model.parts.layer_spec`; their shapes (parameters,
FLOPs, activations) from :mod:`megalite.layers.part_shape`, added up in :mod:`megalite.model.counting`.

Mixture of experts (``--num-experts``): the MLP of the layers ``moe_layers(cfg)`` picks is a
:class:`megalite.moe.block.MoEMLP` (router, experts spread over the expert-parallel group,
the aux losses entering backward on their own); the block reads the same.

Multi-token prediction (``--mtp-num-layers``, :mod:`megalite.model.mtp`): the last stage holds
``mtp``, the D extra depths, and given labels returns :class:`~megalite.model.mtp.MTPLosses` (the
main and each depth's per-token losses) instead of the main losses alone. The depths embed with
the word embedding, so the last stage holds it: tied models hold that copy already, an untied
one gets the same kind of copy (``embedding_copy``, summed with the first stage's by the
embedding-group all-reduce), marked ``tied_embedding`` like the tied one.

Parallelism enters only through the layers (``megalite.layers.tensor_parallel``): with
a TP group of one rank they are plain linears and embeddings. Activations inside the
model are sequence-first, (s, b, h); under sequence parallelism the residual stream holds
this rank's s/TP positions.

Initialization is GPT-2's (N(0, 0.02), output projections of each residual branch
scaled by 1/sqrt(2 * layers), biases 0, norms 1), drawn per parameter from
``(seed, name)`` in full and then sliced: see ``megalite.parallel.random``.
"""
from __future__ import annotations

import functools
import math

import torch
from torch import nn

from megalite.config import ModelConfig
from megalite.layers.documents import Documents
from megalite.layers.fp8 import fp8_autocast
from megalite.layers.rotary import rotary_angles
from megalite.layers.weight_grad import embedding, linear, mark_deferred
from megalite.model.attention import SelfAttention  # noqa: F401  (the default attention part)
from megalite.model.counting import skipped_expert_parameters
from megalite.model.linears import linears_for
from megalite.model.mlp import MLP  # noqa: F401  (the dense MLP part)
from megalite.model.mtp import MTPLosses, MultiTokenPrediction, mtp_depths, shifted_targets
from megalite.model.parts import LayerSpec, attention_part, layer_spec
from megalite.moe.block import MoEMLP
from megalite.layers.tensor_parallel import (ColumnParallelLinear, VocabParallelEmbedding,
                                             sequence_parallel_linear, vocab_parallel_cross_entropy)
from megalite.parallel import comm
from megalite.parallel.random import get_rng_tracker, init_full_tensor
from megalite.parallel.sharding import mark_sequence_parallel
from megalite.model.recompute import run_layers


class ParallelDropout(nn.Dropout):
    """Dropout on the residual stream. Replicated over TP (same mask on every TP rank, the
    default RNG stream), except under sequence parallelism, where each TP rank holds
    different positions and draws from the tensor-parallel stream."""

    def __init__(self, p: float, sequence_parallel: bool):
        super().__init__(p)
        self.sequence_parallel = sequence_parallel

    def forward(self, x):
        if self.sequence_parallel and self.training and self.p > 0:
            with get_rng_tracker().fork():
                return self._drop(x)
        return self._drop(x)

    def _drop(self, x):
        if x.device.type == "meta" and self.training and self.p > 0:
            # A dry run measures a GPU's memory: there F.dropout is the fused kernel, keeping a
            # 1-byte mask (the composite path the meta device would take keeps one of x's dtype).
            return torch.ops.aten.native_dropout(x, self.p, True)[0]
        return super().forward(x)


class TransformerBlock(nn.Module):
    """x + attn(norm(x)), then + mlp(norm(.)); dropout on each branch output.

    Each norm is registered before the branch it feeds (with transformer-engine it lives
    inside the branch's first linear, and the first registration names its parameters)."""

    def __init__(self, cfg: ModelConfig, tp_group=None, sequence_parallel: bool = False, cp_group=None,
                 moe: bool = False, ep_group=None, token_group=None, cp_hierarchy: tuple = (None, None),
                 spec: LayerSpec | None = None):
        """``spec``: the layer's parts (:func:`megalite.model.parts.layer_spec`; default: the
        config's attention, a dense or MoE MLP as ``moe`` says)."""
        super().__init__()
        spec = spec or LayerSpec(attention_part(cfg), moe, linears_for(cfg))
        attn = spec.attention(cfg, tp_group, sequence_parallel, cp_group, cp_hierarchy)
        self.attn_norm = spec.linears.norm_before(attn.input_linear, cfg, sequence_parallel)
        self.attn = attn
        if spec.moe:
            shared = cfg.moe_shared_expert_intermediate_size
            self.mlp_norm = spec.linears.norm(cfg, sequence_parallel)
            self.mlp = MoEMLP(cfg, tp_group, sequence_parallel, cp_group, ep_group, token_group,
                              shared_expert=spec.mlp(cfg, tp_group, sequence_parallel, shared) if shared else None)
        else:
            mlp = spec.mlp(cfg, tp_group, sequence_parallel, norm_inside=True)
            self.mlp_norm = spec.linears.norm_before(mlp.input_linear, cfg, sequence_parallel)
            self.mlp = mlp
        self.dropout = ParallelDropout(cfg.hidden_dropout, sequence_parallel)

    def forward(self, x: torch.Tensor, rope=None, cache=None, documents: Documents | None = None) -> torch.Tensor:
        x = x + self.dropout(self.attn(self.attn_norm(x), rope, cache, documents))
        return x + self.dropout(self.mlp(self.mlp_norm(x)))


class GPTModel(nn.Module):
    """GPT over the layers ``layer_range`` (all by default).

    ``pre_process``: this module embeds tokens (first pipeline stage).
    ``post_process``: this module applies the final norm, output layer and loss (last stage).
    ``forward`` takes (b, s) tokens/positions/labels and returns per-token losses (b, s)
    when labels are given, else logits (b, s, vocab) over the real (unpadded) vocabulary;
    a middle stage returns its hidden states (s, b, h). ``documents``: packed documents (every
    token attends within its own; see megalite.layers.documents), whole-sequence arrays.
    """

    def __init__(self, cfg: ModelConfig, padded_vocab_size: int | None = None,
                 pre_process: bool = True, post_process: bool = True,
                 layer_range: range | None = None, tp_group=None, sequence_parallel: bool = False,
                 cp_group=None, ep_group=None, token_group=None, amax_group=None,
                 cp_hierarchy: tuple = (None, None)):
        """``ep_group`` / ``token_group``: the expert-parallel group and the ranks holding one
        micro-batch together (TP x CP), for MoE layers (see megalite.moe.block).
        ``cp_hierarchy``: (inner, outer) groups of ``--cp-comm-type a2a+p2p``.
        ``amax_group``: the ranks that reduce FP8 amaxes together (the pipeline stage)."""
        super().__init__()
        self.cfg = cfg
        self.amax_group = amax_group
        self.tp_group, self.sequence_parallel = tp_group, sequence_parallel
        self.cp_size = comm.group_size(cp_group)
        self.pre_process, self.post_process = pre_process, post_process
        self.vocab_size = cfg.vocab_size
        self.padded_vocab_size = padded_vocab_size or cfg.padded_vocab_size(comm.group_size(tp_group))
        self.layer_range = layer_range if layer_range is not None else range(cfg.num_layers)
        par = dict(tp_group=tp_group, sequence_parallel=sequence_parallel)
        tied = not cfg.untie_embeddings_and_output_weights
        depths = mtp_depths(cfg)
        shared = tied or depths > 0  # the last stage uses the word embedding (output layer or MTP's input)
        if pre_process or (post_process and shared):
            # A last stage that uses the embedding but does not embed holds its own copy, kept
            # equal to the first stage's by the embedding-group all-reduce.
            self.word_embeddings = VocabParallelEmbedding(self.padded_vocab_size, cfg.hidden_size, **par)
            if shared:
                self.word_embeddings.weight.tied_embedding = True
                if not pre_process:
                    self.word_embeddings.weight.embedding_copy = True
        if pre_process:
            if cfg.position_embedding_type == "learned_absolute":
                # On meta (as pretrain builds) nn.Embedding's own normal_ init is skipped: init_weights
                # draws every parameter, and normal_ on meta imports torch._dynamo (~1.3 s per process).
                shape = (cfg.max_position_embeddings, cfg.hidden_size)
                weight = torch.empty(shape) if torch.get_default_device().type == "meta" else None
                self.position_embeddings = nn.Embedding(*shape, _weight=weight)
                mark_deferred(self.position_embeddings.weight)
                if sequence_parallel:
                    mark_sequence_parallel(self.position_embeddings.weight)
            self.embedding_dropout = ParallelDropout(cfg.hidden_dropout, sequence_parallel)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(cfg, **par, cp_group=cp_group, ep_group=ep_group,
                                                              token_group=token_group, cp_hierarchy=cp_hierarchy,
                                                              spec=layer_spec(cfg, i))
                                     for i in self.layer_range})
        if post_process:
            self.final_norm = linears_for(cfg).norm(cfg, sequence_parallel)
            if not tied:
                self.output_layer = ColumnParallelLinear(cfg.hidden_size, self.padded_vocab_size,
                                                         bias=False, **par)
        self.mtp = None
        if post_process and depths:
            spec = layer_spec(cfg, cfg.num_layers - 1)  # Megatron: the last layer's spec (MoE if it is)
            blocks = [TransformerBlock(cfg, **par, cp_group=cp_group, ep_group=ep_group, token_group=token_group,
                                       cp_hierarchy=cp_hierarchy, spec=spec) for _ in range(depths)]
            self.mtp = MultiTokenPrediction(cfg, blocks, **par)

    # -- forward ---------------------------------------------------------------------------------
    def embed(self, tokens: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        x = self.word_embeddings(tokens.t())  # (s, b, h); under SP this rank's (s/TP, b, h)
        if self.cfg.position_embedding_type == "learned_absolute":
            positions = position_ids.t()
            if self.sequence_parallel:
                positions = comm.split_dim(positions, 0, self.tp_group)
            x = x + embedding(positions, self.position_embeddings.weight)
        return self.embedding_dropout(x)

    def output_logits(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's vocabulary slice of the logits, (s, b, V_padded / TP)."""
        if self.cfg.untie_embeddings_and_output_weights:
            return self.output_layer(x)
        if self.sequence_parallel:
            return sequence_parallel_linear(x, self.word_embeddings.weight, None, self.tp_group)
        return linear(comm.copy_to_tp(x, self.tp_group), self.word_embeddings.weight)

    def forward(self, tokens: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                labels: torch.Tensor | None = None, hidden: torch.Tensor | None = None, kv_cache=None,
                documents: Documents | None = None, mtp_labels: torch.Tensor | None = None):
        """``kv_cache`` (generation, :class:`megalite.layers.kv_cache.KVCache`): ``tokens`` are the
        next positions after the cached ones; their keys and values join the cache.
        ``mtp_labels``: the MTP depths' targets (b, s, D) of this rank's positions
        (:func:`megalite.model.mtp.shifted_targets`, built before a CP split); default: shifted
        here from ``labels``, which must then be the whole sequence."""
        ref = tokens if tokens is not None else labels
        if position_ids is None and ref is not None:
            start = kv_cache.length if kv_cache is not None else 0
            position_ids = torch.arange(start, start + ref.shape[1], device=ref.device).expand_as(ref)
        x = self.embed(tokens, position_ids) if self.pre_process else hidden
        rope = None
        if self.cfg.position_embedding_type == "rope":
            rope = rotary_angles(position_ids, self.cfg.rotary_dim, self.cfg.rotary_base, self.cfg.rope_scaling)
        if kv_cache is not None:
            for name, layer in self.layers.items():
                x = layer(x, rope, kv_cache.layer(name))
            kv_cache.advance(position_ids.shape[1])
        else:
            layers = list(self.layers.values())
            if documents is not None:
                layers = [functools.partial(layer, documents=documents) for layer in layers]
            with fp8_autocast(self.cfg, self.amax_group, self):  # a no-op without --fp8-format
                x = run_layers(layers, x, rope, self.cfg.recompute_granularity,
                               self.cfg.recompute_method, self.cfg.recompute_num_layers, self.training)
        if not self.post_process:
            return x
        x = self.final_norm(x)
        logits = self.output_logits(x)
        if labels is None:  # full logits, for inspection and generation (not the loss path)
            full = comm.gather_from_tp(logits, self.tp_group)[..., : self.vocab_size]
            return full.transpose(0, 1)
        losses = vocab_parallel_cross_entropy(logits, labels.t(), self.vocab_size, self.tp_group,
                                              fused=self.cfg.fused_kernels).t()  # (b, s)
        if self.mtp is None:
            return losses
        if mtp_labels is None:
            mtp_labels = shifted_targets(labels, None, len(self.mtp.layers), documents)[0]
        mtp = self.mtp(x, labels, mtp_labels, lambda ids: self.word_embeddings(ids.t()), self.token_losses,
                       rope, documents)
        return MTPLosses(losses, mtp, self.cfg.mtp_loss_scaling_factor / len(self.mtp.layers))

    def token_losses(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Per-token cross-entropy (b, s) of the output layer on normalised hidden states x (s, b, h)."""
        return vocab_parallel_cross_entropy(self.output_logits(x), targets.t(), self.vocab_size, self.tp_group,
                                            fused=self.cfg.fused_kernels).t()

    # -- initialization --------------------------------------------------------------------------
    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """GPT-2 init, reproducible per parameter from (seed, global name), layout-independent.

        Each full tensor is drawn on the CPU (one parameter at a time, so the whole model is
        never held there), sliced to this rank's shard and copied to the parameter's device:
        the same seed gives the same model on every device and under every layout. On meta
        there is nothing to draw."""
        std = self.cfg.init_method_std
        output_std = std / math.sqrt(2.0 * self.cfg.num_layers)
        for name, param in self.named_parameters():
            if param.device.type == "meta" or getattr(param, "expert_parallel", False):
                continue  # experts: drawn per global expert index below
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
            elif getattr(param, "residual_output", False):  # the branch's last linear (model/linears.py)
                full = init_full_tensor(full_shape, seed, name, output_std)
            else:
                full = init_full_tensor(full_shape, seed, name, std)
            shard = param.shard_fn(full) if hasattr(param, "shard_fn") else full
            param.copy_(shard)
        for name, module in self.named_modules():
            if isinstance(module, MoEMLP):
                module.init_expert_weights(seed, f"{name}.", std, output_std)


def materialize(module: nn.Module, device: torch.device) -> nn.Module:
    """Give a module built on the meta device uninitialized storage on ``device``, keeping
    every Parameter's attributes (TP split, sequence-parallel marks): ``Module.to_empty``
    would make new Parameter objects without them. On meta, nothing to do."""
    device = torch.device(device)
    if device.type == "meta":
        return module
    done: dict = {}
    for mod in module.modules():
        for name, param in list(mod._parameters.items()):
            if param is None or param.device == device:
                continue
            if param not in done:
                new = nn.Parameter(torch.empty_like(param, device=device), requires_grad=param.requires_grad)
                new.__dict__.update(param.__dict__)
                done[param] = new
            mod._parameters[name] = done[param]
        for name, buf in list(mod._buffers.items()):
            if buf is not None and buf.device != device:
                mod._buffers[name] = torch.empty_like(buf, device=device)
    return module


def count_parameters(cfg: ModelConfig) -> int:
    """Parameters of the full model (tied embedding counted once, real vocabulary)."""
    with torch.device("meta"):
        model = GPTModel(cfg, padded_vocab_size=cfg.vocab_size)
    return sum(p.numel() for p in model.parameters())


def count_active_parameters(cfg: ModelConfig) -> int:
    """Parameters one token meets (for FLOPs): an MoE layer's token uses topk of its experts."""
    return count_parameters(cfg) - skipped_expert_parameters(cfg)
