"""Mixture-of-experts settings: which layers are MoE, and every rule the flags must follow.

``validate_moe`` is called by :func:`megalite.config.validate` (before any group or model
exists); each rule raises :class:`ConfigError` naming the values, the rule and a fix.
"""
from __future__ import annotations

import functools
import json
import os
import re

from megalite.errors import ConfigError


def parse_layer_freq(value) -> int | list:
    """``--moe-layer-freq``: an int N (layers 0, N, 2N, ... are MoE) or a 0/1 list, one entry per
    layer, written ``[1,0,1,0]`` (JSON) or as Megatron's Python-list pattern ``([0]*3+[1]*58)``
    (first 3 layers dense; :func:`layer_pattern`)."""
    if isinstance(value, (int, list)):
        return value
    text = str(value).strip().strip("'\"").strip()
    if text.startswith(("[", "(")):
        try:
            pattern = json.loads(text)
        except json.JSONDecodeError:
            pattern = layer_pattern(text)
        if not isinstance(pattern, list) or any(v not in (0, 1) for v in pattern):
            raise ConfigError(f"--moe-layer-freq {value!r}: a list must hold 0s and 1s, written [1,0,1,0] or as "
                              f"a pattern of lists, + and * such as ([0]*3+[1]*58). Fix: e.g. [1,0,1,0].")
        return pattern
    try:
        return int(text)
    except ValueError:
        raise ConfigError(f"--moe-layer-freq {value!r} is neither a number nor a list. Fix: give an integer "
                          f"N (every N-th layer is MoE) or a 0/1 list such as [1,0,1,0].") from None


_PATTERN_TOKEN = re.compile(r"\s*(\d+|[\[\]()+*,])")


def layer_pattern(text: str) -> list | None:
    """Megatron's ``--moe-layer-freq`` list pattern without ``eval``: lists of integers,
    parentheses, ``a + b`` (concatenation) and ``list * n`` / ``n * list`` (repetition), e.g.
    ``([0]*3+[1]*58)`` or ``([1]*3+[0])*2``. None when the text is not such a pattern."""
    tokens, pos, text = [], 0, text.strip()
    while pos < len(text):
        match = _PATTERN_TOKEN.match(text, pos)
        if not match:
            return None
        tokens.append(match.group(1))
        pos = match.end()
    tokens.append("$")
    at = 0

    def peek():
        return tokens[at]

    def take(expected=None):
        nonlocal at
        token = tokens[at]
        if expected is not None and token != expected:
            raise ValueError(token)
        at += 1
        return token

    def atom():
        if peek() == "(":
            take("(")
            value = expr()
            take(")")
            return value
        if peek() == "[":
            take("[")
            items = []
            while peek() != "]":
                items.append(int(take()))
                if peek() == ",":
                    take(",")
            take("]")
            return items
        return int(take())

    def term():
        value = atom()
        while peek() == "*":
            take("*")
            other = atom()
            value = value * other if isinstance(value, list) != isinstance(other, list) else None
            if value is None:
                raise ValueError("*")
        return value

    def expr():
        value = term()
        while peek() == "+":
            take("+")
            value = value + term()
        return value

    try:
        value = expr()
        take("$")
    except (ValueError, TypeError, IndexError):
        return None
    return value if isinstance(value, list) else None


SCORE_FUNCTIONS = ("softmax", "sigmoid")  # the router scores of megalite.moe.scoring


def check_routing(num_experts: int, topk: int, num_groups: int | None, group_topk: int | None,
                  score_function: str = "softmax") -> str | None:
    """The first rule the routing settings break, as a message naming the value, the rule and a
    fix (the flags' names); None when they are fine."""
    E, k = num_experts, topk
    if score_function not in SCORE_FUNCTIONS:
        return (f"--moe-router-score-function {score_function!r} is not one of {SCORE_FUNCTIONS}. "
                f"Fix: softmax (the default) or sigmoid (DeepSeek-V3).")
    if (num_groups is None) != (group_topk is None):
        return (f"--moe-router-num-groups {num_groups} and --moe-router-group-topk {group_topk}: group-limited "
                f"routing needs both. Fix: give both (e.g. 8 and 4, DeepSeek-V3) or neither.")
    if num_groups is None:
        return None
    if num_groups < 1 or E % num_groups:
        return (f"--moe-router-num-groups {num_groups} does not divide --num-experts {E}: the experts are split "
                f"into equal groups. Fix: choose a number of groups dividing {E}.")
    if not 1 <= group_topk <= num_groups:
        return (f"--moe-router-group-topk {group_topk} must be in [1, --moe-router-num-groups {num_groups}]: "
                f"a token keeps that many of the groups. Fix: lower --moe-router-group-topk.")
    if k > group_topk * (E // num_groups):
        return (f"--moe-router-topk {k} exceeds the {group_topk * (E // num_groups)} experts of the kept groups "
                f"(--moe-router-group-topk {group_topk} x {E // num_groups} experts per group): a token picks k "
                f"distinct experts among them. Fix: raise --moe-router-group-topk or lower --moe-router-topk.")
    return None


def moe_layers(cfg) -> list[bool]:
    """For each layer (global index), whether its MLP is a mixture of experts."""
    if not cfg.num_experts:
        return [False] * cfg.num_layers
    freq = cfg.moe_layer_freq
    return list(_moe_pattern(cfg.num_layers, tuple(freq) if isinstance(freq, list) else freq))


@functools.lru_cache(maxsize=256)
def _moe_pattern(num_layers: int, freq) -> tuple[bool, ...]:
    """:func:`moe_layers` of a --moe-layer-freq value, once per value (the planner asks per layer,
    hundreds of thousands of times a search)."""
    freq = parse_layer_freq(list(freq) if isinstance(freq, tuple) else freq)
    if isinstance(freq, list):
        return tuple(bool(v) for v in freq)
    return tuple(i % freq == 0 for i in range(num_layers))


def validate_moe(m, p, t, world_size: int) -> None:
    ep, etp = p.expert_model_parallel_size, p.expert_tensor_parallel_size
    tp, pp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size
    m.moe_layer_freq = parse_layer_freq(m.moe_layer_freq)  # the flag's text -> int or list
    if not m.num_experts:
        if ep != 1:
            raise ConfigError(f"--expert-model-parallel-size {ep} without --num-experts: there are no "
                              f"experts to split. Fix: add --num-experts E (a multiple of {ep}) or drop "
                              f"the flag.")
        return
    E, k = m.num_experts, m.moe_router_topk
    if E < 1:
        raise ConfigError(f"--num-experts must be a positive integer, got {E}. Fix: drop it for a dense model.")
    if not 1 <= k <= E:
        raise ConfigError(f"--moe-router-topk {k} must be in [1, --num-experts {E}]: each token picks k "
                          f"distinct experts. Fix: lower --moe-router-topk.")
    if m.moe_ffn_hidden_size is None or m.moe_ffn_hidden_size < 1:
        raise ConfigError(f"--moe-ffn-hidden-size must be a positive integer, got {m.moe_ffn_hidden_size}. "
                          f"Fix: drop it (each expert then has --ffn-hidden-size).")
    freq = m.moe_layer_freq
    if isinstance(freq, list):
        if len(freq) != m.num_layers:
            raise ConfigError(f"--moe-layer-freq lists {len(freq)} layers but the model has --num-layers "
                              f"{m.num_layers}. Fix: one 0/1 entry per layer.")
    elif freq < 1:
        raise ConfigError(f"--moe-layer-freq {freq} must be >= 1. Fix: 1 makes every layer MoE, 2 every other.")
    problem = check_routing(E, k, m.moe_router_num_groups, m.moe_router_group_topk, m.moe_router_score_function)
    if problem:
        raise ConfigError(problem)
    if m.moe_router_topk_scaling_factor is not None and m.moe_router_topk_scaling_factor <= 0:
        raise ConfigError(f"--moe-router-topk-scaling-factor {m.moe_router_topk_scaling_factor} must be positive: "
                          f"it multiplies the top-k weights. Fix: e.g. 2.5 (DeepSeek-V3), or drop it for 1.")
    if m.moe_router_bias_update_rate < 0:
        raise ConfigError(f"--moe-router-bias-update-rate {m.moe_router_bias_update_rate} must be >= 0: the "
                          f"expert bias moves by it towards balance each step. Fix: 1e-3 (the default).")
    if m.moe_router_load_balancing_type not in ("aux_loss", "none"):
        raise ConfigError(f"--moe-router-load-balancing-type {m.moe_router_load_balancing_type!r} is not "
                          f"implemented. Fix: aux_loss (Switch/GShard) or none.")
    if m.moe_aux_loss_coeff < 0 or (m.moe_z_loss_coeff or 0) < 0:
        raise ConfigError(f"--moe-aux-loss-coeff ({m.moe_aux_loss_coeff}) and --moe-z-loss-coeff "
                          f"({m.moe_z_loss_coeff}) must be >= 0. Fix: 0 turns a loss off (1e-2 and 1e-3 are usual).")
    if m.moe_expert_capacity_factor is not None and m.moe_expert_capacity_factor <= 0:
        raise ConfigError(f"--moe-expert-capacity-factor must be positive, got {m.moe_expert_capacity_factor}. "
                          f"Fix: a factor such as 1.25, or leave it unset for dropless routing.")
    if m.moe_shared_expert_intermediate_size is not None:
        if m.moe_shared_expert_intermediate_size < 1 or m.moe_shared_expert_intermediate_size % tp:
            raise ConfigError(f"--moe-shared-expert-intermediate-size {m.moe_shared_expert_intermediate_size} "
                              f"must be a positive multiple of --tensor-model-parallel-size {tp} (the shared "
                              f"expert is a dense MLP split over TP). Fix: round it to a multiple of {tp}.")
    if etp != 1:
        raise ConfigError(f"--expert-tensor-parallel-size {etp}: megalite keeps each expert whole on its "
                          f"rank (ETP = 1, the layout Megatron recommends for MoE) and spreads experts "
                          f"with --expert-model-parallel-size instead. Fix: --expert-tensor-parallel-size 1.")
    if ep < 1 or E % ep:
        raise ConfigError(f"--num-experts ({E}) must be divisible by --expert-model-parallel-size ({ep}): "
                          f"each expert-parallel rank holds E/EP experts. Fix: choose EP dividing {E}.")
    stage_ranks = world_size // pp if world_size % pp == 0 else 0
    if stage_ranks % ep:
        raise ConfigError(f"--expert-model-parallel-size ({ep}) must divide the ranks of one pipeline stage, "
                          f"TP*CP*DP = {stage_ranks} (world {world_size} / PP {pp}): expert-parallel groups "
                          f"are carved out of them. Fix: choose EP dividing {stage_ranks}.")
    if tp > 1 and not p.sequence_parallel:
        raise ConfigError(f"MoE with --tensor-model-parallel-size {tp} needs --sequence-parallel (as in "
                          f"Megatron): each TP rank then routes its own part of the sequence. Fix: add "
                          f"--sequence-parallel.")
    if t.zero_stage == 3:
        raise ConfigError("--zero-stage 3 with --num-experts: expert weights are sharded over the "
                          "expert-data-parallel group, which ZeRO-3's layer-by-layer gathering does not "
                          "know yet. Fix: --zero-stage 1 or 2.")
    if m.moe_grouped_gemm:
        import torch

        if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
            raise ConfigError("--moe-grouped-gemm runs a Triton kernel: it needs a GPU (or TRITON_INTERPRET=1, "
                              "the slow CPU interpreter, for tests). Fix: drop --moe-grouped-gemm on a CPU.")
