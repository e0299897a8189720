"""Attention: one function that every part of the model calls, so backends can be swapped.

``attention(q, k, v)`` computes ``softmax(q k^T / sqrt(d) + mask) v`` per head, with
q of shape (b, heads, s_q, d), k of shape (b, groups, s_k, d) and v of shape (b, groups, s_k,
d_v); the output is (b, heads, s_q, d_v). Grouped-query attention: each key/value group serves
``heads / groups`` consecutive query heads. The value head size d_v may differ from d
(DeepSeek-V3's MLA: 192 and 128): torch, triton and meta take it; flash-attn 2 does not, so the
flash backend refuses it (``refuse_flash_value_head_size``) and ``auto`` never picks flash for it.

Backends (``--attention-backend``), all giving the same numbers up to rounding:

- ``torch``: ``scaled_dot_product_attention`` (picks its own fused kernel on a GPU).
- ``triton``: megalite's flash-attention kernel (``megalite.kernels.flash_attention``);
  no attention dropout. On a CPU it needs ``TRITON_INTERPRET=1`` (tests only).
- ``flash``: flash-attn's ``flash_attn_func`` on a CUDA GPU, fp16/bf16; layout (b, s, h, d).
- ``auto``: the fastest that can run this call: flash (installed, GPU, fp16/bf16), else
  triton (GPU, no dropout), else torch.

Causal masks are aligned top-left: query i sees keys j <= i (as SDPA's ``is_causal``).
flash-attn is imported only when the flash backend runs (or auto picks it).

Packed documents (``documents``, :class:`megalite.layers.documents.Documents`): query i sees key
j iff ``doc_start[i] <= j <= i``. torch: SDPA with that boolean (b, 1, s, s) mask; triton: the
kernels' ``doc_start`` / ``doc_end`` (tiles outside every document are skipped); meta: shapes
only. flash: refused (flash-attn's varlen API is the way, but it cannot be tested without a
GPU here), and ``auto`` never picks flash for documents.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from megalite.errors import ConfigError
from megalite.layers.backends import flash_missing, triton_missing
from megalite.layers.documents import Documents, visible_mask
from megalite.kernels.attention_reference import fold_head_max, logit_row_max

BACKENDS = ("auto", "triton", "flash", "torch")
TRITON_MAX_HEAD_DIM = 256  # megalite.kernels._utils.MAX_HEAD_DIM (not imported here: no triton import)


class BackendUnavailable(RuntimeError):
    """A backend was asked for that cannot run here; the message names what is missing."""


def check_attention_backend(model_config) -> None:
    """Validation hook called by megalite.config.validate: raise ConfigError when the chosen
    backend is unknown or unavailable, or cannot run this model (the message names the fix).
    Also checks ``--fused-kernels`` (Triton norms and cross-entropy) can run here."""
    name = model_config.attention_backend
    if name not in BACKENDS:
        raise ConfigError(f"--attention-backend {name!r} is unknown. Fix: use one of "
                          f"{', '.join(BACKENDS)}.")
    if name == "triton":
        why = triton_missing()
        if why:
            raise ConfigError(f"--attention-backend triton cannot run: {why}. Fix: set that up, "
                              f"or use --attention-backend torch.")
        if model_config.attention_dropout > 0:
            raise ConfigError(f"--attention-backend triton has no attention dropout (the Triton "
                              f"flash kernel never materializes the probabilities to drop), got "
                              f"--attention-dropout {model_config.attention_dropout}. Fix: pass "
                              f"--attention-dropout 0, or use --attention-backend torch or flash.")
        if not model_config.multi_latent_attention and model_config.head_dim > TRITON_MAX_HEAD_DIM:
            # (MLA's own query/key and value sizes are checked by config.check_multi_latent_attention)
            own = model_config.kv_channels is not None
            head_size, smaller = (("--kv-channels", "a smaller --kv-channels") if own
                                  else ("hidden/heads", "use more heads"))
            raise ConfigError(f"--attention-backend triton supports head dims up to "
                              f"{TRITON_MAX_HEAD_DIM}, got {head_size} = {model_config.head_dim}. "
                              f"Fix: {smaller}, or --attention-backend torch or flash.")
    if name == "flash":
        why = flash_missing()
        if why:
            raise ConfigError(f"--attention-backend flash cannot run: {why}. Fix: install it on "
                              f"a GPU machine, or use --attention-backend torch or triton.")
    if model_config.fused_kernels:
        why = triton_missing()
        if why:
            raise ConfigError(f"--fused-kernels (Triton norms and cross-entropy) cannot run: "
                              f"{why}. Fix: set that up, or drop --fused-kernels.")


def require_flash(q: torch.Tensor, what: str) -> None:
    """Raise BackendUnavailable unless flash-attn can take ``q`` here (installed, a CUDA tensor,
    fp16/bf16); ``what`` names the caller in the message."""
    why = flash_missing(q.device.type)
    if why:
        raise BackendUnavailable(f"{what} cannot run: {why}. Fix: install it on a GPU machine, or use "
                                 f"the triton or torch backend.")
    if q.dtype not in (torch.float16, torch.bfloat16):
        raise BackendUnavailable(f"flash-attn takes float16 or bfloat16, got {q.dtype}. Fix: "
                                 f"train with --bf16/--fp16, or use the triton or torch backend.")


def refuse_flash_documents(what: str) -> None:
    raise BackendUnavailable(f"{what} does not take packed documents (--reset-attention-mask) in "
                             f"megalite: flash-attn's varlen API would, but it is not wired in (it cannot "
                             f"be tested without a GPU). Fix: --attention-backend triton (or auto, "
                             f"or torch).")


def refuse_flash_logit_max(what: str) -> None:
    """Raise BackendUnavailable: flash-attn returns no attention-logit max (QK-clip needs one)."""
    raise BackendUnavailable(f"{what} cannot give the per-head max attention logit that --qk-clip and "
                             f"--log-max-attention-logit need (flash-attn returns no such statistic). Fix: "
                             f"--attention-backend triton (or auto, or torch).")


def refuse_flash_value_head_size(what: str, head_dim: int, v_head_dim: int) -> None:
    """Raise BackendUnavailable when flash-attn is asked for a value head size ``v_head_dim``
    other than the query/key one ``head_dim`` (flash-attn 2's kernels take one head size)."""
    if v_head_dim != head_dim:
        raise BackendUnavailable(f"{what} takes one head size for q, k and v (flash-attn 2), got a "
                                 f"query/key head size of {head_dim} and a value head size of "
                                 f"{v_head_dim}. Fix: --attention-backend triton (or auto, or torch).")


def resolve_backend(backend: str, q: torch.Tensor, dropout_p: float = 0.0, documents: bool = False,
                    v_head_dim: int | None = None) -> str:
    """The backend that runs this call: ``auto`` becomes flash, triton or torch (see module
    docstring); the others are returned as asked after checking they can run here.
    ``documents``: the call has packed documents (flash refuses them, auto skips it).
    ``v_head_dim``: v's head size when it differs from q's (flash refuses it, auto skips it)."""
    device = q.device.type
    v_head_dim = q.shape[-1] if v_head_dim is None else v_head_dim
    if backend == "auto":
        if not documents and v_head_dim == q.shape[-1] and flash_missing(device) is None \
                and q.dtype in (torch.float16, torch.bfloat16):
            return "flash"
        if device == "cuda" and dropout_p == 0 and triton_missing(device) is None \
                and max(q.shape[-1], v_head_dim) <= TRITON_MAX_HEAD_DIM:
            return "triton"
        return "torch"
    if backend == "triton":
        why = triton_missing(device)
        if why:
            raise BackendUnavailable(f"attention backend 'triton' cannot run: {why}.")
        if dropout_p > 0:
            raise BackendUnavailable(f"attention backend 'triton' has no dropout, got dropout_p="
                                     f"{dropout_p}. Fix: dropout 0, or the torch or flash backend.")
    elif backend == "flash":
        if documents:
            refuse_flash_documents("attention backend 'flash'")
        refuse_flash_value_head_size("attention backend 'flash'", q.shape[-1], v_head_dim)
        require_flash(q, "attention backend 'flash'")
    elif backend != "torch":
        raise BackendUnavailable(f"attention backend {backend!r} is unknown; use one of "
                                 f"{', '.join(BACKENDS)}.")
    return backend


class _MetaFlashAttention(torch.autograd.Function):
    """Attention on meta tensors (a dry run), with the memory of the kernels that run on a GPU
    (Triton, flash-attn, SDPA's flash / memory-efficient): backward keeps q, k, v, the output
    and one fp32 log-sum-exp per row, never the (s_q x s_k) probabilities that the math path
    materializes. Nothing is computed on meta, so only the shapes and dtypes matter."""

    @staticmethod
    def forward(ctx, q, k, v):
        # Compact copies, as the planner (megalite/planner/estimate.py) counts Q, K, V. On a GPU every
        # backend saves its inputs as given, which costs the same: without RoPE q, k, v are
        # views that keep the fused qkv (= q + k + v) alive; with RoPE q and k are new tensors
        # and the model copies v out of qkv (SelfAttention.forward), so qkv is freed.
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        b, h, s, d_v = *q.shape[:3], v.shape[3]  # laid out (s, b, heads, d_v), as the Triton kernel writes it
        out = torch.empty((s, b, h, d_v), dtype=q.dtype, device=q.device).permute(1, 2, 0, 3)
        lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, _, _ = ctx.saved_tensors
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True,
              dropout_p: float = 0.0, backend: str = "torch", documents: Documents | None = None,
              logit_max: torch.Tensor | None = None) -> torch.Tensor:
    """Output (b, heads, s_q, d_v) from q (b, heads, s_q, d), k (b, groups, s_k, d) and v (b, groups,
    s_k, d_v) (the value head size may differ from the query/key one, module docstring).
    ``documents``: packed documents over the whole sequence (s_q = s_k = s), causal only.
    ``logit_max`` (QK-clip, :mod:`megalite.model.qk_clip`): a float32 (heads,) device tensor raised
    in place to each head's largest visible logit ``q.k / sqrt(d)`` of this call (masked keys
    excluded), no host read: triton writes its running row max, torch computes it apart
    (``logit_row_max``, only when asked); flash-attn cannot give it (refused; auto skips flash)."""
    if documents is not None and (not causal or q.shape[2] != k.shape[2]):
        raise ValueError(f"packed documents need causal self-attention over the whole sequence, got "
                         f"causal={causal}, s_q {q.shape[2]}, s_k {k.shape[2]}.")
    if q.device.type == "meta":
        return _MetaFlashAttention.apply(q, k, v)
    if documents is None and v.shape[-1] == q.shape[-1] and logit_max is None:
        backend = resolve_backend(backend, q, dropout_p)
    else:  # flash refuses each; auto passes over it
        if logit_max is not None and backend == "flash":
            refuse_flash_logit_max("attention backend 'flash'")
        backend = resolve_backend(backend, q, dropout_p, documents=documents is not None or logit_max is not None,
                                  v_head_dim=v.shape[-1])
    if backend == "triton":
        from megalite.kernels.flash_attention import flash_attention

        row_max = None if logit_max is None else q.new_empty(q.shape[:3], dtype=torch.float32)
        if documents is not None:
            out = flash_attention(q, k, v, causal=True, doc_start=documents.start, doc_end=documents.end,
                                  row_max=row_max)
        else:
            out = flash_attention(q, k, v, causal=causal, row_max=row_max)
        if row_max is not None:
            fold_head_max(logit_max, row_max)
        return out
    if logit_max is not None:  # torch: SDPA gives no statistics, so the scores' max is taken apart
        fold_head_max(logit_max, logit_row_max(q.detach(), k.detach(), causal,
                                               doc_start=None if documents is None else documents.start))
    if backend == "flash":
        if causal and q.shape[2] != k.shape[2]:
            raise ValueError(f"causal attention with s_q {q.shape[2]} != s_k {k.shape[2]}: "
                             f"flash-attn aligns the mask bottom-right, the other backends "
                             f"top-left. Fix: use the triton backend (explicit offsets).")
        from flash_attn import flash_attn_func  # (b, s, heads, d); GQA as ours

        out = flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                              dropout_p=dropout_p, causal=causal)
        return out.transpose(1, 2)
    d_v = v.shape[-1]
    q, k, v, scale = _one_head_size_on_cpu(q, k, v)
    groups, heads = k.shape[1], q.shape[1]
    if documents is not None:  # the causal and document mask in one (SDPA takes one or the other)
        mask = visible_mask(documents, q.shape[2], k.shape[2])
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p,
                                             enable_gqa=groups != heads, scale=scale)
    else:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, dropout_p=dropout_p,
                                             enable_gqa=groups != heads, scale=scale)
    return out[..., :d_v] if out.shape[-1] != d_v else out


def _one_head_size_on_cpu(q, k, v):
    """q, k, v zero-padded to one head size D = max(d, d_v) on a CPU, and the softmax scale
    1/sqrt(d) of the unpadded q (None: SDPA's default, nothing padded).

    The CPU's fused SDPA kernel takes only one head size for q, k and v; with d_v != d (MLA)
    SDPA falls back to its math path, which materialises the (s_q x s_k) probabilities and ran
    1.4x slower (tools/bench_models.py, docs/BENCHMARKS.md). Zero columns change nothing:
    q k^T gains only 0 * 0 terms, and zero value columns give zero output columns, which the
    caller slices off (their gradients are dropped by the pad's backward). On a GPU SDPA's
    memory-efficient and cuDNN kernels take d_v != d as they are, so nothing is padded there."""
    d, d_v = q.shape[-1], v.shape[-1]
    if d == d_v or q.device.type != "cpu":
        return q, k, v, None
    size = max(d, d_v)
    return F.pad(q, (0, size - d)), F.pad(k, (0, size - d)), F.pad(v, (0, size - d_v)), d ** -0.5
