"""What a model part says about itself without being built: its linears, its other parameters,
its FLOPs per token and the activations it keeps for backward.

A part (an attention, an MLP: the modules in ``megalite/model/``) inherits :class:`PartShape`,
or a shape below, and describes its weight matrices as :class:`LinearShape` rows; the counting
(:mod:`megalite.model.counting`), the planner's memory (and so the dry run's planned column),
``megalite.moe.planning`` and MFU read every shape from there. Pure arithmetic on a model config
(any object with its fields), on the layers' floor so that ``moe/``, which does not import the
model, shares it with the model. The rules a part follows:

- **Parameters**: each linear's ``in x out`` weight (+ ``out`` bias), split over TP when the
  linear is column-parallel (its output rows) or row-parallel (its input columns); a row-parallel
  linear's bias is replicated (added after the reduction). Anything else the part holds is
  ``extra_parameters`` (split, replicated).
- **FLOPs per token, forward**: 2 per weight a token meets (a multiply-add), plus what the
  weights do not count: ``attended_flops`` per position a token attends to (softmax attention:
  ``Q K^T`` and ``P V``, 2 x 2 x heads x head_dim = 4 h). Training counts 3 x forward (backward
  is two matmuls per forward one); full recomputation adds one forward.
- **Activations kept for backward**, bytes per micro-batch of ``s b`` tokens, e = activation
  bytes: ``replicated`` (held whole on every TP rank, a sequence shard under SP), ``split``
  (divided over TP), and ``recomputable`` (what selective recomputation or a flash-style kernel
  does not keep, divided over TP).
- **Generation cache** (attention parts), elements per token per layer on one TP rank:
  ``cache_buffers`` lists the buffers the KV cache allocates for the part, (n, w) each
  (:mod:`megalite.layers.kv_cache`); ``cache_elements_per_token`` is their sum of n w, the one
  definition of cache bytes per token (times the cache's element bytes).
"""
from __future__ import annotations

from dataclasses import dataclass

from megalite.layers.logical_matrices import row_block


@dataclass(frozen=True)
class LinearShape:
    """One weight matrix of a part: ``out x in``, column-parallel (output rows split over TP)
    or row-parallel (input columns split)."""
    name: str
    in_features: int
    out_features: int
    column: bool
    bias: bool

    @property
    def weight(self) -> int:
        return self.in_features * self.out_features

    def split_parameters(self) -> int:
        """Elements split over TP (full size): the weight, and a column-parallel bias."""
        return self.weight + (self.out_features if self.bias and self.column else 0)

    def replicated_parameters(self) -> int:
        """Elements every TP rank holds whole: a row-parallel linear's bias."""
        return self.out_features if self.bias and not self.column else 0

    def parameter_list(self, tp: int) -> list[int]:
        """Elements of the weight and bias on one TP rank, in registration order."""
        bias = [self.out_features // tp if self.column else self.out_features] if self.bias else []
        return [self.weight // tp] + bias

    def local_shape(self, tp: int = 1) -> tuple[int, int]:
        """(rows, cols) of the weight on one TP rank: a column-parallel linear's rows divided by
        t, a row-parallel one's columns."""
        return (self.out_features // tp, self.in_features) if self.column else (self.out_features, self.in_features // tp)

    def logical_shapes(self, m, tp: int = 1, split_qkv: bool = True) -> list[tuple[int, int]]:
        """(rows, cols) of each matrix the weight holds (:mod:`megalite.layers.logical_matrices`:
        q, k, v of a split qkv; SwiGLU's gate and up), as one TP rank holds it: a column-parallel
        linear's rows divided by t, a row-parallel one's columns."""
        rows, cols = self.local_shape(tp)
        block = row_block(self.name, m, rows, split_qkv)
        return [(rows // sum(block) * width, cols) for width in block]

    def w_inputs_per_token(self, tp: int, sp: bool) -> tuple[float, float]:
        """(x, dy) elements per token its deferred weight gradient keeps: a column linear's input
        is whole (a sequence shard under SP) and its output gradient split; a row linear's input
        is split and its output gradient whole."""
        if self.column:
            return self.in_features / (tp if sp else 1), self.out_features / tp
        return self.in_features / tp, self.out_features


class PartShape:
    """The shape side of a model part (module docstring); a part class overrides what differs."""

    @classmethod
    def linears(cls, m, *size) -> list[LinearShape]:
        """The part's weight matrices; ``size``: a part's own size arguments (the MLP's FFN size)."""
        return []

    @classmethod
    def extra_parameters(cls, m) -> tuple[int, int]:
        """(split over TP, replicated) parameters beyond the linears."""
        return 0, 0

    @classmethod
    def parameter_counts(cls, m, *size) -> tuple[int, int]:
        """(split over TP, replicated) parameters of the part, full size."""
        split, replicated = cls.extra_parameters(m)
        for linear in cls.linears(m, *size):
            split += linear.split_parameters()
            replicated += linear.replicated_parameters()
        return split, replicated

    @classmethod
    def extra_matrices(cls, m) -> tuple[int, int]:
        """(split over TP, replicated) elements of the weight matrices among ``extra_parameters``:
        the replicated ones of :meth:`extra_matrix_shapes`."""
        return 0, sum(rows * cols for rows, cols in cls.extra_matrix_shapes(m))

    @classmethod
    def extra_matrix_shapes(cls, m) -> list[tuple[int, int]]:
        """(rows, cols) of the replicated weight matrices among the extra parameters, which
        :meth:`parameter_list` registers first among them (none by default)."""
        return []

    @classmethod
    def matrix_counts(cls, m, *size) -> tuple[int, int]:
        """(split over TP, replicated) elements of the part's weight matrices, full size: each
        linear's weight and the extra matrices; not its biases or norms. These are the hidden
        matrices an update rule with a matrix class steps as matrices (Muon's
        :func:`megalite.data_parallel.muon.takes_muon`: 2-D weights of the layers), so the
        planner's optimizer-state bytes per class come from here."""
        split, replicated = cls.extra_matrices(m)
        return split + sum(linear.weight for linear in cls.linears(m, *size)), replicated

    @classmethod
    def parameter_list(cls, m, tp: int, *size) -> list[int]:
        """Elements of each parameter on one TP rank, in registration order (the buckets' order):
        the linears', then the extra ones."""
        out = [n for linear in cls.linears(m, *size) for n in linear.parameter_list(tp)]
        split, replicated = cls.extra_parameters(m)
        return out + ([split // tp] if split else []) + ([replicated] if replicated else [])

    @classmethod
    def attended_flops(cls, m) -> float:
        """Forward FLOPs per token per attended position, beyond the weights' 2 per parameter."""
        return 0.0

    @classmethod
    def activation_bytes(cls, m, tokens: float, act_bytes: int, recompute: str = "none",
                         flash_attention: bool = False) -> tuple[float, float, float]:
        """(replicated, split, recomputable) bytes kept for backward by ``tokens`` = s b tokens."""
        return 0.0, 0.0, 0.0

    @classmethod
    def sequence_gathered_bytes(cls, m, s: float, b: int, act_bytes: int) -> float:
        """Of the replicated bytes (:meth:`activation_bytes`), those a part keeps over the whole
        sequence even under sequence parallelism (it gathers the sequence and keeps the gathered
        tensor for backward): counted whole on every rank, not divided by t. None by default."""
        return 0.0

    @classmethod
    def cache_buffers(cls, m, tp: int = 1) -> list[tuple[int, int]]:
        """What generation caches per token for the part on one TP rank: (n, w) per buffer, each
        held as (batch, n, positions, w) (none: a part with no state across positions)."""
        return []

    @classmethod
    def cache_elements_per_token(cls, m, tp: int = 1) -> int:
        """Cached elements per token of one layer on one TP rank: the sum of n w over
        :meth:`cache_buffers` (bytes: times the cache's element size)."""
        return sum(n * w for n, w in cls.cache_buffers(m, tp))

    @classmethod
    def w_input_elements(cls, m, tokens: float, tp: int, sp: bool, *size) -> float:
        """Elements its linears keep between B and W (every input x, then every output gradient dy)."""
        pairs = [linear.w_inputs_per_token(tp, sp) for linear in cls.linears(m, *size)]
        per_token = 0.0
        for value in [x for x, _ in pairs] + [dy for _, dy in pairs]:
            per_token += value
        return tokens * per_token


def norm_parameters(m) -> int:
    """One norm: weight (and bias for LayerNorm) of h."""
    return 2 * m.hidden_size if m.normalization == "LayerNorm" else m.hidden_size


class SelfAttentionShape(PartShape):
    """The shape of :class:`megalite.model.attention.SelfAttention` (grouped-query softmax attention
    of heads a, key/value groups g and head size d = ``head_dim``, apart from hidden/heads with
    ``kv_channels``; QK-norm adds two replicated norms of size d)."""

    @classmethod
    def extra_parameters(cls, m) -> tuple[int, int]:
        """QK-norm: the q and k norms' weights (and biases under LayerNorm), d each, replicated."""
        if not getattr(m, "qk_layernorm", False):
            return 0, 0
        return 0, 2 * (2 if m.normalization == "LayerNorm" else 1) * m.head_dim

    @classmethod
    def parameter_list(cls, m, tp: int, *size) -> list[int]:
        """The linears', then the q norm's and the k norm's parameters (d each) with QK-norm."""
        out = [n for linear in cls.linears(m, *size) for n in linear.parameter_list(tp)]
        _, norms = cls.extra_parameters(m)
        return out + [m.head_dim] * (norms // m.head_dim)

    @classmethod
    def linears(cls, m, *size) -> list[LinearShape]:
        """qkv (h -> (heads + 2 groups) d, column), proj (heads d -> h, row)."""
        h, d, a, g = m.hidden_size, m.head_dim, m.num_attention_heads, m.num_query_groups
        return [LinearShape("qkv", h, (a + 2 * g) * d, True, m.add_bias_linear or m.add_qkv_bias),
                LinearShape("proj", a * d, h, False, m.add_bias_linear)]

    @classmethod
    def cache_buffers(cls, m, tp: int = 1) -> list[tuple[int, int]]:
        """Keys and values of this rank's g / t groups, d each: 2 g d / t elements per token per
        layer (Llama-3-8B, g 8 of d 128: 2048)."""
        return [(m.num_query_groups // tp, m.head_dim)] * 2

    @classmethod
    def attended_flops(cls, m) -> float:
        """Q K^T and P V: 2 matmuls of heads x head_dim per attended position, 2 FLOPs each."""
        return 4.0 * m.num_attention_heads * m.head_dim

    @classmethod
    def activation_bytes(cls, m, s: float, b: int, act_bytes: int, recompute: str = "none",
                         flash_attention: bool = False) -> tuple[float, float, float]:
        """QKV's input (replicated, s b h); Q, K, V and the attention output (split: (2 + 2 g/a)
        s b a d); with QK-norm the norms' inputs too, views that keep the whole qkv output alive
        ((1 + 2 g/a) s b a d more; under grouped-query attention the query heads of each group are
        gathered into a copy the query norm keeps, s b a d more), and their fp32 row statistics
        (1/rms; LayerNorm: and the mean) per head and token; the scores and their dropout mask, (2 e + 1) a s^2 b, unless
        selective recomputation or a flash-style kernel drops them."""
        B, sbh, kv = act_bytes, s * b * m.hidden_size, m.num_query_groups / m.num_attention_heads
        a, g = m.num_attention_heads, m.num_query_groups
        width = s * b * a * m.head_dim  # s b a d (= s b h by default)
        split = B * width * (2 + 2 * kv)
        if getattr(m, "qk_layernorm", False):
            stats = 8 if m.normalization == "LayerNorm" else 4
            split += B * width * (1 + 2 * kv + (g < a)) + stats * s * b * (a + g)
        scores = 0.0 if recompute == "selective" or flash_attention else (2 * B + 1) * a * s * s * b
        return B * sbh, split, scores


class MLPShape(PartShape):
    """The shape of :class:`megalite.model.mlp.MLP` (a dense MLP of FFN size f, default the config's)."""

    @classmethod
    def linears(cls, m, *size) -> list[LinearShape]:
        """fc1 (h -> k f, column; k = 2 with SwiGLU), fc2 (f -> h, row); none for an FFN of 0."""
        f = size[0] if size else m.ffn_hidden_size
        if not f:
            return []
        sections = 2 if m.swiglu else 1
        return [LinearShape("fc1", m.hidden_size, sections * f, True, m.add_bias_linear),
                LinearShape("fc2", f, m.hidden_size, False, m.add_bias_linear)]

    @classmethod
    def activation_bytes(cls, m, s: float, b: int, act_bytes: int, recompute: str = "none",
                         flash_attention: bool = False) -> tuple[float, float, float]:
        """fc1's input (replicated); the activation's inputs and outputs, 2 s b f (GELU) or
        4 s b f (SwiGLU: gate, up, silu(gate) and the product) elements (split)."""
        B = act_bytes
        return B * s * b * m.hidden_size, (4 if m.swiglu else 2) * B * (s * b * m.ffn_hidden_size), 0.0


class MLAShape(PartShape):
    """The shape of :class:`megalite.model.mla.MultiLatentAttention` (DeepSeek-V3's Multi-head
    Latent Attention: heads a, RoPE-free part d_n = ``qk_head_dim``, RoPE part d_r =
    ``qk_pos_emb_head_dim``, value head d_v = ``v_head_dim``, latent ranks r_q = ``q_lora_rank``
    (None: no query latent) and r_kv = ``kv_lora_rank``).

    Linears (split over TP by heads): the query's up-projection r_q -> a (d_n + d_r) (or h -> it
    without a query latent), the key/value up-projection r_kv -> a (d_n + d_v) (column), and the
    output projection a d_v -> h (row). Replicated extras: the down-projections h x r_q and
    h x (r_kv + d_r) (the key/value latent and the shared RoPE key in one matrix) and the norms of
    the two latents (r_q and r_kv; LayerNorm: with biases); they are plain linears here, not TP
    ones (their weight gradients are summed over TP, not deferred)."""

    @staticmethod
    def _norm(m, n: int) -> int:
        return (2 if m.normalization == "LayerNorm" else 1) * n

    @classmethod
    def linears(cls, m, *size) -> list[LinearShape]:
        h, a = m.hidden_size, m.num_attention_heads
        dn, dr, dv = m.qk_head_dim, m.qk_pos_emb_head_dim, m.v_head_dim
        q_in = m.q_lora_rank or h
        return [LinearShape("q_up" if m.q_lora_rank else "q_proj", q_in, a * (dn + dr), True, False),
                LinearShape("kv_up", m.kv_lora_rank, a * (dn + dv), True, False),
                LinearShape("proj", a * dv, h, False, m.add_bias_linear)]

    @classmethod
    def replicated_list(cls, m) -> list[int]:
        """The replicated parameters in registration order: q_down, kv_down, then the norms'
        (weight, bias under LayerNorm) of the query latent (with one) and the key/value latent."""
        h, rq, rkv, dr = m.hidden_size, m.q_lora_rank, m.kv_lora_rank, m.qk_pos_emb_head_dim
        norms_q = [rq] * (cls._norm(m, 1)) if rq else []
        return ([h * rq] if rq else []) + [h * (rkv + dr)] + norms_q + [rkv] * cls._norm(m, 1)

    @classmethod
    def extra_parameters(cls, m) -> tuple[int, int]:
        return 0, sum(cls.replicated_list(m))

    @classmethod
    def extra_matrix_shapes(cls, m) -> list[tuple[int, int]]:
        """The down-projections q_down (r_q x h, with a query latent) and kv_down ((r_kv + d_r) x h),
        replicated, the first of :meth:`replicated_list`."""
        h, rq = m.hidden_size, m.q_lora_rank
        return ([(rq, h)] if rq else []) + [(m.kv_lora_rank + m.qk_pos_emb_head_dim, h)]

    @classmethod
    def parameter_list(cls, m, tp: int, *size) -> list[int]:
        """The linears' (split), then the replicated ones (:meth:`replicated_list`)."""
        return [n for linear in cls.linears(m, *size) for n in linear.parameter_list(tp)] + cls.replicated_list(m)

    @classmethod
    def cache_buffers(cls, m, tp: int = 1) -> list[tuple[int, int]]:
        """One buffer of r_kv + d_r per token: the normed key/value latent c and the rotated RoPE
        key shared by the heads (keys and values are W_ukv c, :mod:`megalite.model.mla`), on
        every TP rank whole (the latent is replicated; each rank up-projects it for its heads).
        DeepSeek-V3 (r_kv 512, d_r 64): 576 elements, against its 128 heads' uncompressed keys
        and values, 128 x (192 + 128) = 40960, and a GQA layer's 2 g d."""
        return [(1, m.kv_lora_rank + m.qk_pos_emb_head_dim)]

    @classmethod
    def attended_flops(cls, m) -> float:
        """Q K^T over d_qk = d_n + d_r and P V over d_v: a (d_qk + d_v) multiply-adds, 2 a (d_qk + d_v)
        FLOPs per attended position (softmax attention's 4 a d when d_qk = d_v = d)."""
        return 2.0 * m.num_attention_heads * (m.qk_head_dim + m.qk_pos_emb_head_dim + m.v_head_dim)

    @classmethod
    def activation_bytes(cls, m, s: float, b: int, act_bytes: int, recompute: str = "none",
                         flash_attention: bool = False) -> tuple[float, float, float]:
        """Replicated: the input (s b h) and the latents the up-projections and norms keep (the
        query latent before and after its norm, 2 r_q; the key/value latent and RoPE key,
        r_kv + d_r, and the normed latent r_kv), per token: all computed from the gathered input
        under SP, so kept whole (:meth:`sequence_gathered_bytes`).
        Split: what the core attention keeps, q and k (a d_qk each), v (a d_v, a copy out of the
        key/value up-projection's output, which nothing keeps) and the attention output (a d_v,
        the output projection's input too). Recomputable: the scores and their dropout mask,
        (2 e + 1) a s^2 b, unless selective recomputation or a flash kernel."""
        B, a = act_bytes, m.num_attention_heads
        dn, dr, dv = m.qk_head_dim, m.qk_pos_emb_head_dim, m.v_head_dim
        replicated = cls.sequence_gathered_bytes(m, s, b, act_bytes)
        split = B * s * b * a * (2 * (dn + dr) + 2 * dv)
        scores = 0.0 if recompute == "selective" or flash_attention else (2 * B + 1) * a * s * s * b
        return replicated, split, scores

    @classmethod
    def sequence_gathered_bytes(cls, m, s: float, b: int, act_bytes: int) -> float:
        """All of its replicated bytes: under SP the down-projections see the gathered sequence
        (``MultiLatentAttention.entered``), so their input (h) and the latents computed from it
        (2 r_q + 2 r_kv + d_r per token) are kept whole on every TP rank."""
        latents = 2 * (m.q_lora_rank or 0) + 2 * m.kv_lora_rank + m.qk_pos_emb_head_dim
        return act_bytes * s * b * (m.hidden_size + latents)
