"""A stand-in for transformer-engine's PyTorch API, for testing megalite's adapter on a CPU.

transformer-engine builds and imports only with CUDA and cuDNN, and neither test machine has
it. This module gives the part of its interface megalite calls, with TE 2.x's documented
semantics (read from its source), so the adapter's own logic is tested: sizes given in full
and divided by the TP size; column/row parallel modes doing their own all-gather /
reduce-scatter / all-reduce along dim 0 (real gloo collectives through megalite's conjugate
pairs), the row bias added after the reduction; ``layer_norm_weight``/``layer_norm_bias``; the
``sequence_parallel`` marks TE sets; deferred init on ``device="meta"``; DotProductAttention's
(s, b, h, d) layout with total head counts; FP8 delayed scaling's per-module state
(``fp8_meta``, ``init_fp8_metadata``, ``get_fp8_meta_tensors`` / ``reset_fp8_meta_tensors``),
created at the first forward under the autocast and updated at its exit after an all-reduce
(MAX) of the amaxes over the amax group; the userbuffer switches of ``--tp-comm-overlap``
(``initialize_ub`` before any layer that uses them; each switch holds only for its parallel
mode under SP): the communication stays the plain collective, but every tensor a switched-on
userbuffer would carry is checked against the buffers ``initialize_ub`` made (TE's buffer
names ``{qkv,proj,fc1,fc2}_{fprop,dgrad,wgrad}``, each of the given ``shape`` and ``dtype``)
and counted in ``UB["used"]``. Signatures take exactly TE's argument names (no
``**kwargs``), so a misspelled argument fails here as it would there.

FP8 numbers are imitated, not reproduced: inputs and weights are rounded to a fixed-point grid
set by their scale (so a lost scale changes the loss), never to real e4m3/e5m2. The real
library is tested by the ``gpu`` tests in tests/test_transformer_engine.py where it is installed.
"""
from __future__ import annotations

import contextlib
import enum
import importlib.machinery
import math
import sys
import types

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from megalite.parallel import comm

_STATE = {"enabled": False, "recipe": None, "group": None, "modules": []}
UB = {"initialized": None, "used": {}}  # initialize_ub's arguments while the userbuffers exist;
# "used": {buffer name: how many tensors went through it} (checked against the buffer)

# TE's userbuffers (module/base.py, initialize_ub): one per layer and pass, each of the
# ``shape`` given (the full (s b, h) tokens of all TP ranks), in ``dtype`` (all-gathers in
# FP8 under use_fp8).
UB_NAMES = {f"{layer}_{p}" for layer in ("qkv", "proj", "fc1", "fc2") for p in ("fprop", "dgrad", "wgrad")}


def initialize_ub(shape: list, tp_size: int, use_fp8: bool = False, quantization_modes=None,
                  dtype: torch.dtype = torch.bfloat16, ub_cfgs=None, bootstrap_backend=None,
                  with_cublasmp: bool = False):
    if UB["initialized"] is not None:
        raise RuntimeError("UB communicators are already initialized.")
    assert dist.is_initialized() and dist.get_world_size() % tp_size == 0
    UB["initialized"] = dict(shape=list(shape), tp_size=tp_size, use_fp8=use_fp8, dtype=dtype,
                             bootstrap_backend=bootstrap_backend)
    UB["used"] = {}


def destroy_ub():
    UB["initialized"] = None


def _through_ub(name: str, t: torch.Tensor) -> None:
    """``t`` (the full, all-TP-ranks tensor a userbuffer all-gathers or reduce-scatters) goes
    through buffer ``name``: it must be one TE made, and fit it exactly, as TE copies the
    chunks of every rank into it (a tensor of another size, or dtype, is an error there)."""
    ub = UB["initialized"]
    assert ub is not None, f"userbuffer {name} used after destroy_ub() or before initialize_ub()"
    assert name in UB_NAMES, f"no userbuffer {name!r}: initialize_ub makes only {sorted(UB_NAMES)}"
    rows = math.prod(t.shape[:-1])
    assert [rows, t.shape[-1]] == ub["shape"], (f"userbuffer {name}: a {[rows, t.shape[-1]]} tensor in a "
                                                f"buffer of {ub['shape']}")
    assert ub["use_fp8"] or t.dtype == ub["dtype"], f"userbuffer {name}: {t.dtype} in a {ub['dtype']} buffer"
    UB["used"][name] = UB["used"].get(name, 0) + 1


def _ub_grad(name: str, t: torch.Tensor) -> None:
    if t.requires_grad:
        t.register_hook(lambda g: _through_ub(name, g))


# -- transformer_engine.common.recipe ----------------------------------------------------------
class _Fmt:
    def __init__(self, max_fwd, max_bwd):
        self.max_fwd, self.max_bwd = max_fwd, max_bwd


class Format(enum.Enum):
    E4M3 = _Fmt(448.0, 448.0)
    HYBRID = _Fmt(448.0, 57344.0)


class DelayedScaling:
    def __init__(self, margin: int = 0, fp8_format: Format = Format.HYBRID, amax_history_len: int = 1024,
                 amax_compute_algo: str = "max", reduce_amax: bool = True):
        self.margin, self.fp8_format, self.amax_history_len = margin, fp8_format, amax_history_len
        self.amax_compute_algo, self.reduce_amax = amax_compute_algo, reduce_amax


# -- FP8 state -----------------------------------------------------------------------------------
class _ScalingState:
    def __init__(self, n: int, history: int):
        self.scale = torch.ones(n)
        self.amax_history = torch.zeros(history, n)


def _quantize(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The stand-in's 'FP8': a fixed-point grid of step 1/(16 scale) (a wrong scale shows)."""
    step = 1.0 / (16.0 * scale)
    return x + ((x / step).round() * step - x).detach()  # straight-through


@contextlib.contextmanager
def _autocast(enabled, recipe, group):
    saved = dict(_STATE)
    _STATE.update(enabled=enabled, recipe=recipe or DelayedScaling(), group=group, modules=[])
    try:
        yield
    finally:
        modules = _STATE["modules"]
        if enabled and torch.is_grad_enabled() and modules:
            _reduce_and_update(modules, _STATE["recipe"], group)
        _STATE.clear()
        _STATE.update(saved)


def _reduce_and_update(modules, recipe, group) -> None:
    current = torch.cat([m.fp8_meta["scaling_fwd"].amax_history[0] for m in modules])
    if recipe.reduce_amax and dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(current, op=dist.ReduceOp.MAX, group=group)
    offset = 0
    for m in modules:
        state = m.fp8_meta["scaling_fwd"]
        n = state.scale.numel()
        state.amax_history[0] = current[offset: offset + n]
        offset += n
        amax = state.amax_history.max(0).values if recipe.amax_compute_algo == "max" else state.amax_history[0]
        fp8_max = recipe.fp8_format.value.max_fwd
        new = torch.where(amax > 0, fp8_max / amax / 2 ** recipe.margin, state.scale)
        state.scale.copy_(new)
        state.amax_history.copy_(torch.roll(state.amax_history, 1, 0))
        state.amax_history[0] = 0


def fp8_autocast(enabled: bool = True, calibrating: bool = False, fp8_recipe=None, fp8_group=None, _graph=False):
    return _autocast(enabled, fp8_recipe, fp8_group)


def autocast(enabled: bool = True, calibrating: bool = False, recipe=None, amax_reduction_group=None, _graph=False):
    return _autocast(enabled, recipe, amax_reduction_group)


class _BaseModule(nn.Module):
    def __init__(self, tp_group, tp_size):
        super().__init__()
        self.fp8_meta = {}
        self.fp8_initialized = False
        self.tp_group = tp_group
        self.tp_size = dist.get_world_size(tp_group) if tp_group is not None else tp_size

    def init_fp8_metadata(self, num_gemms: int = 1) -> None:
        if not _STATE["enabled"]:
            return
        if not self.fp8_initialized:
            length = _STATE["recipe"].amax_history_len
            self.fp8_meta["scaling_fwd"] = _ScalingState(3 * num_gemms, length)
            self.fp8_meta["scaling_bwd"] = _ScalingState(2 * num_gemms, length)
            self.fp8_initialized = True
        if self not in _STATE["modules"]:
            _STATE["modules"].append(self)

    def get_fp8_meta_tensors(self):
        if "scaling_fwd" not in self.fp8_meta:
            return None
        return {k: [self.fp8_meta[k].scale.clone(), self.fp8_meta[k].amax_history.clone()]
                for k in ("scaling_fwd", "scaling_bwd")}

    def reset_fp8_meta_tensors(self, fp8_meta_tensors=None) -> None:
        with torch.no_grad():
            for k in ("scaling_fwd", "scaling_bwd"):
                if k in self.fp8_meta:
                    self.fp8_meta[k].scale.copy_(fp8_meta_tensors[k][0])
                    self.fp8_meta[k].amax_history.copy_(fp8_meta_tensors[k][1])

    def _fp8_inputs(self, x, w):
        """Record this forward's amaxes (row 0 of the history) and quantize with the scales."""
        self.init_fp8_metadata()
        if not _STATE["enabled"]:
            return x, w
        state = self.fp8_meta["scaling_fwd"]
        with torch.no_grad():
            state.amax_history[0, 0] = torch.maximum(state.amax_history[0, 0], x.detach().abs().max().float())
            state.amax_history[0, 1] = torch.maximum(state.amax_history[0, 1], w.detach().abs().max().float())
        return _quantize(x, state.scale[0]), _quantize(w, state.scale[1])


def _param(shape, device, dtype, fill=None):
    t = torch.empty(shape, device=device, dtype=dtype)
    if fill is not None and t.device.type != "meta":
        t.fill_(fill)
    return nn.Parameter(t)


class Linear(_BaseModule):
    def __init__(self, in_features: int, out_features: int, sequence_parallel: bool = False,
                 fuse_wgrad_accumulation: bool = False, tp_group=None, tp_size: int = 1,
                 get_rng_state_tracker=None, rng_tracker_name=None, init_method=None, bias: bool = True,
                 return_bias: bool = False, params_dtype=None, parallel_mode=None, parameters_split=None,
                 device="cuda", ub_overlap_ag: bool = False, ub_overlap_rs: bool = False,
                 ub_overlap_rs_dgrad: bool = False, ub_bulk_dgrad: bool = False, ub_bulk_wgrad: bool = False,
                 ub_name=None):
        super().__init__(tp_group, tp_size)
        assert parallel_mode in ("row", "column", None)
        self.parallel_mode = parallel_mode
        self.sequence_parallel = self.tp_size > 1 and sequence_parallel
        column, row = (self.sequence_parallel and parallel_mode == m for m in ("column", "row"))
        # TE's overlap switches: each holds only for its parallel mode under SP
        self.ub = {"ag_fprop": column and ub_overlap_ag, "rs_dgrad": column and ub_overlap_rs_dgrad,
                   "bulk_dgrad": column and ub_bulk_dgrad and not ub_overlap_rs_dgrad,
                   "bulk_wgrad": column and ub_bulk_wgrad and not ub_overlap_rs_dgrad,
                   "rs_fprop": row and ub_overlap_rs, "ag_dgrad": row and ub_overlap_ag}
        if any(self.ub.values()):
            assert UB["initialized"] is not None, "initialize_ub() must be called before layer construction."
            assert ub_name is not None
        self.ub_name = ub_name
        if parallel_mode == "column":
            assert out_features % self.tp_size == 0
            out_features //= self.tp_size
        elif parallel_mode == "row":
            assert in_features % self.tp_size == 0
            in_features //= self.tp_size
        self.in_features, self.out_features = in_features, out_features
        dtype = params_dtype or torch.get_default_dtype()
        self.weight = _param((out_features, in_features), device, dtype)
        self.use_bias = bias
        self.bias = _param((out_features,), device, dtype, 0.0) if bias else torch.Tensor()
        if torch.device(device).type != "meta":  # TE's reset_parameters (deferred on meta)
            if init_method is not None:
                init_method(self.weight)
            self.weight.partition_dim = 1 if parallel_mode == "row" else 0
            if bias and parallel_mode == "row":
                self.bias.sequence_parallel = self.sequence_parallel

    def _enter(self, x):
        if self.parallel_mode == "column":
            if self.sequence_parallel:
                x = comm.gather_from_sp(x, self.tp_group)
                if self.ub["ag_fprop"]:  # the input, all-gathered chunk by chunk in the GEMM
                    _through_ub(f"{self.ub_name}_fprop", x)
                if self.ub["bulk_dgrad"] or self.ub["rs_dgrad"]:  # its gradient, reduce-scattered
                    _ub_grad(f"{self.ub_name}_dgrad", x)
                if self.ub["bulk_wgrad"]:  # (bulk: the gathered input is kept for the wgrad GEMM)
                    _ub_grad(f"{self.ub_name}_wgrad", x)
                return x
            return comm.copy_to_tp(x, self.tp_group)
        return x

    def _linear(self, x):
        x, w = self._fp8_inputs(x, self.weight)
        if self.parallel_mode == "row":
            y = F.linear(x, w)
            if self.ub["rs_fprop"]:  # the output, reduce-scattered in the GEMM
                _through_ub(f"{self.ub_name}_fprop", y)
            if self.ub["ag_dgrad"]:  # the output gradient, all-gathered in the dgrad GEMM
                _ub_grad(f"{self.ub_name}_dgrad", y)
            if self.sequence_parallel:
                y = comm.reduce_scatter_to_sp(y, self.tp_group)
            else:
                y = comm.reduce_from_tp(y, self.tp_group)
            return y + self.bias if self.use_bias else y  # the full bias, after the collective
        return F.linear(x, w, self.bias if self.use_bias else None)

    def forward(self, inp, is_first_microbatch=None, fp8_output=False, fp8_grad=False):
        return self._linear(self._enter(inp))


class LayerNormLinear(Linear):
    def __init__(self, in_features: int, out_features: int, eps: float = 1e-5, sequence_parallel: bool = False,
                 fuse_wgrad_accumulation: bool = False, tp_group=None, tp_size: int = 1,
                 get_rng_state_tracker=None, init_method=None, bias: bool = True, normalization: str = "LayerNorm",
                 return_bias: bool = False, params_dtype=None, parallel_mode=None,
                 return_layernorm_output: bool = False, return_layernorm_output_gathered: bool = False,
                 parameters_split=None, zero_centered_gamma: bool = False, device="cuda",
                 ub_overlap_ag: bool = False, ub_overlap_rs: bool = False, ub_overlap_rs_dgrad: bool = False,
                 ub_bulk_wgrad: bool = False, ub_bulk_dgrad: bool = False, ub_name=None):
        assert normalization in ("LayerNorm", "RMSNorm")
        if parallel_mode == "row":
            raise NotImplementedError("Normalization does not support tensor-parallel distribution.")
        super().__init__(in_features, out_features, sequence_parallel=sequence_parallel, tp_group=tp_group,
                         tp_size=tp_size, init_method=init_method, bias=bias, params_dtype=params_dtype,
                         parallel_mode=parallel_mode, device=device, ub_overlap_ag=ub_overlap_ag,
                         ub_overlap_rs=ub_overlap_rs, ub_overlap_rs_dgrad=ub_overlap_rs_dgrad,
                         ub_bulk_dgrad=ub_bulk_dgrad, ub_bulk_wgrad=ub_bulk_wgrad, ub_name=ub_name)
        self.eps, self.normalization = eps, normalization
        dtype = params_dtype or torch.get_default_dtype()
        self.layer_norm_weight = _param((in_features,), device, dtype, 1.0)
        self.layer_norm_bias = _param((in_features,), device, dtype, 0.0) if normalization == "LayerNorm" else None
        if torch.device(device).type != "meta":
            self.layer_norm_weight.sequence_parallel = self.sequence_parallel
            if self.layer_norm_bias is not None:
                self.layer_norm_bias.sequence_parallel = self.sequence_parallel

    def forward(self, inp, is_first_microbatch=None, fp8_output=False, fp8_grad=False):
        x = _normalize(inp, self.normalization, self.layer_norm_weight, self.layer_norm_bias, self.eps)
        return self._linear(self._enter(x))


def _normalize(x, kind, weight, bias, eps):
    x32 = x.float()
    if kind == "LayerNorm":
        y = F.layer_norm(x32, (x.shape[-1],), weight.float(), bias.float(), eps)
    else:
        y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    return y.to(x.dtype)


class LayerNorm(nn.Module):
    def __init__(self, normalized_shape=None, eps: float = 1e-5, sequence_parallel=None, params_dtype=None,
                 zero_centered_gamma: bool = False, hidden_size=None, device=None, dtype=None):
        super().__init__()
        n = normalized_shape or hidden_size
        dtype = dtype or params_dtype or torch.get_default_dtype()
        self.eps = eps
        self.weight = _param((n,), device, dtype, 1.0)
        self.bias = _param((n,), device, dtype, 0.0)

    def forward(self, x):
        return _normalize(x, "LayerNorm", self.weight, self.bias, self.eps)


class RMSNorm(nn.Module):
    def __init__(self, normalized_shape=None, eps: float = 1e-5, sequence_parallel=None, params_dtype=None,
                 zero_centered_gamma: bool = False, hidden_size=None, device=None, dtype=None):
        super().__init__()
        n = normalized_shape or hidden_size
        self.eps = eps
        self.weight = _param((n,), device, dtype or params_dtype or torch.get_default_dtype(), 1.0)

    def forward(self, x):
        return _normalize(x, "RMSNorm", self.weight, None, self.eps)


class DotProductAttention(_BaseModule):
    def __init__(self, num_attention_heads: int, kv_channels: int, num_gqa_groups=None,
                 attention_dropout: float = 0.0, qkv_format: str = "sbhd", attn_mask_type: str = "causal",
                 window_size=None, sequence_parallel: bool = False, tp_size: int = 1,
                 get_rng_state_tracker=None, tp_group=None, layer_number=None, attention_type: str = "self",
                 cp_group=None, cp_global_ranks=None, cp_stream=None, cp_comm_type: str = "p2p",
                 softmax_scale=None):
        super().__init__(tp_group, tp_size)
        assert qkv_format == "sbhd" and attn_mask_type == "causal"
        self.kv_channels = kv_channels
        self.groups_per_partition = (num_gqa_groups or num_attention_heads) // self.tp_size
        self.dropout = attention_dropout
        self.tracker = None if (sequence_parallel or get_rng_state_tracker is None) else get_rng_state_tracker
        self.scale = softmax_scale or 1.0 / math.sqrt(kv_channels)

    def forward(self, query_layer, key_layer, value_layer, attention_mask=None, qkv_format=None):
        s, b, h, d = query_layer.shape
        assert key_layer.shape[2] == self.groups_per_partition, (key_layer.shape, self.groups_per_partition)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query_layer, key_layer, value_layer))
        rep = h // k.shape[1]
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        p = self.dropout if self.training else 0.0
        ctx = self.tracker().fork() if (self.tracker and p > 0) else contextlib.nullcontext()
        with ctx:
            out = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True, scale=self.scale)
        return out.permute(2, 0, 1, 3).reshape(s, b, h * d)


# -- installing it -------------------------------------------------------------------------------
def install(monkeypatch, version: str = "2.9") -> types.ModuleType:
    """Put the stand-in in sys.modules as ``transformer_engine`` (``version`` "2.8": only
    ``fp8_autocast``; "2.9" and later: ``autocast`` too) and tell megalite it can run here."""
    root = types.ModuleType("transformer_engine")
    root.__version__ = version
    root.__spec__ = importlib.machinery.ModuleSpec("transformer_engine", None)
    pytorch = types.ModuleType("transformer_engine.pytorch")
    pytorch.module = types.SimpleNamespace(base=types.SimpleNamespace(initialize_ub=initialize_ub,
                                                                      destroy_ub=destroy_ub))
    for obj in (Linear, LayerNormLinear, LayerNorm, RMSNorm, DotProductAttention, fp8_autocast):
        setattr(pytorch, obj.__name__, obj)
    if version != "2.8":
        pytorch.autocast = autocast
    common = types.ModuleType("transformer_engine.common")
    recipe = types.ModuleType("transformer_engine.common.recipe")
    recipe.DelayedScaling, recipe.Format = DelayedScaling, Format
    root.pytorch, root.common, common.recipe = pytorch, common, recipe
    for name, module in (("transformer_engine", root), ("transformer_engine.pytorch", pytorch),
                         ("transformer_engine.common", common), ("transformer_engine.common.recipe", recipe)):
        monkeypatch.setitem(sys.modules, name, module)
    import megalite.layers.norms
    import megalite.layers.transformer_engine

    for module in (megalite.layers.transformer_engine, megalite.layers.norms):
        monkeypatch.setattr(module, "te_missing", lambda: None)  # as on a GPU with transformer-engine
    return root
