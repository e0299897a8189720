"""Hugging Face ``DeepseekV3ForCausalLM``'s multi-token-prediction layers <-> megalite's MTP depths.

Multi-token prediction is DeepSeek-V3's section 2.2 and megalite's ``--mtp-num-layers``
(:mod:`megalite.model.mtp`). The hub's files hold ``num_nextn_predict_layers`` = D extra layers,
``model.layers.{n + k}.*`` (n = ``num_hidden_layers``, k = 0..D-1), which transformers does not
load: a decoder layer (the same names as the main layers', MLA and MoE with its
``e_score_correction_bias``) beside ``enorm``, ``hnorm``, ``eh_proj``, ``shared_head.norm``,
``shared_head.head`` and ``embed_tokens``. They are megalite's ``mtp.layers.{k}.*``: the decoder
layer is ``block.*`` (mapped as a main layer is, RoPE rows included; MoE like megalite's last
layer, which DeepSeek-V3's dense-first rule makes it), ``enorm`` / ``hnorm`` / ``eh_proj`` keep their
names and ``shared_head.norm`` is the depth's ``final_norm``. The meaning, as the released weights
are used (DeepSeek's README_WEIGHTS.md, and the inference engines that load them):
``eh_proj`` (h x 2h) takes [enorm(Emb token t+k); hnorm(h_{k-1}[t])], the embedding in its first h
input columns (the report's equation writes the two the other way round; ``enorm`` is the one
applied to the embedding), and the depth's logits are ``shared_head.head(shared_head.norm(.))``.
``embed_tokens`` and ``shared_head.head`` are copies of the main model's embedding and output
layer (shared, per the README): megalite shares them, so the import checks each copy equals the
main tensor bit for bit and refuses a checkpoint whose copy differs (:func:`check_mtp`, before
anything is written); the export writes the main tensors again as the copies. D comes from the
files, and config.json's ``num_nextn_predict_layers`` must agree
(:func:`megalite.checkpoint.hf_deepseek.mtp_layers_in`), except that a file saved by transformers,
which drops the MTP layers but keeps the key, imports without MTP and one line saying so
(:func:`absent_mtp_note`); the export writes D. Not in config.json, so
not carried: ``--mtp-loss-scaling-factor`` (megalite's default 0.1, DeepSeek-V3's value after
its first 10T tokens).

With megalite's depth k = 1..D (:mod:`megalite.model.mtp`; HF layer n + k - 1) this reads::

    h_k[t] = shared_head.norm(Block(eh_proj [enorm(Emb x_{t+k}); hnorm(h_{k-1}[t])]))
    logits_k[t] = shared_head.head h_k[t]  (= lm_head)      predicting x_{t+k+1}

with h_0 the main model's normalised last hidden state (Megatron's and megalite's reading of the
report's "representation given by the main model"). For D >= 2 the hidden state handed to the next depth is h_k, the
normalised one (Megatron's and megalite's choice; DeepSeek-V3's released checkpoints have D = 1,
where the question does not arise).
"""
from __future__ import annotations

import torch

from megalite.checkpoint.hf_deepseek import export_block, import_block
from megalite.checkpoint.hf_llama import UnsupportedModel, global_names
from megalite.config import ModelConfig
from megalite.config_types import mtp_depths
from megalite.moe.settings import moe_layers


def absent_mtp_note(hf: dict, cfg: ModelConfig) -> str | None:
    """One line when config.json announces MTP layers the files do not hold (transformers'
    ``save_pretrained`` drops them), or None."""
    said = hf.get("num_nextn_predict_layers") or 0
    if not said or cfg.mtp_num_layers:
        return None
    return (f"note: config.json says num_nextn_predict_layers {said} but the files hold no "
            f"model.layers.{cfg.num_layers}.* tensors (transformers does not save them): imported without "
            f"multi-token prediction (--mtp-num-layers off)")


# megalite (after mtp.layers.{k}.) <- HF (after model.layers.{n+k}.), besides the decoder layer
MTP_NAMES = {"enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight", "eh_proj.weight": "eh_proj.weight",
             "final_norm.weight": "shared_head.norm.weight"}


def _shared_copies(cfg: ModelConfig) -> dict[str, str]:
    """HF name of each MTP layer's copy (after ``model.layers.{n+k}.``) -> the main model's tensor it
    copies (megalite's name)."""
    head = "output_layer.weight" if cfg.untie_embeddings_and_output_weights else "word_embeddings.weight"
    return {"embed_tokens.weight": "word_embeddings.weight", "shared_head.head.weight": head}


def check_mtp(get, has, cfg: ModelConfig) -> None:
    """Before anything is written: each MTP layer has its own tensors, and its copies of the
    embedding and output layer (where the files hold them) equal the main model's bit for bit
    (megalite's depths share them), or one refusal naming the tensor."""
    main_names = global_names(cfg)
    for k in range(mtp_depths(cfg)):
        p = f"model.layers.{cfg.num_layers + k}."
        missing = [p + theirs for theirs in MTP_NAMES.values() if not has(p + theirs)]
        if missing:
            raise UnsupportedModel(f"config.json num_nextn_predict_layers {cfg.mtp_num_layers}: MTP layer {p}* "
                                   f"lacks {missing}; every MTP layer has enorm, hnorm, eh_proj and shared_head.norm "
                                   f"(DeepSeek-V3's files). Fix: complete the files, or drop that layer's tensors and "
                                   f"lower num_nextn_predict_layers.")
        for theirs, ours in _shared_copies(cfg).items():
            if not has(p + theirs):
                continue
            copy, main = get(p + theirs), get(main_names[ours])
            if copy.shape != main.shape or not torch.equal(copy, main):
                diff = "shape " + str(tuple(copy.shape)) if copy.shape != main.shape else \
                    f"max |difference| {(copy.float() - main.float()).abs().max().item():.3g}"
                raise UnsupportedModel(
                    f"{p}{theirs} differs from {main_names[ours]} ({diff}): megalite's multi-token-prediction "
                    f"depths share the main model's embedding and output layer, as DeepSeek-V3's do, so a depth "
                    f"with its own cannot be imported. Fix: if they were meant to be shared, copy "
                    f"{main_names[ours]} over it; else drop the model.layers.{cfg.num_layers}.. tensors and set "
                    f"num_nextn_predict_layers 0 to import the main model alone.")


def _mtp_is_moe(cfg: ModelConfig) -> bool:
    """megalite builds each depth's block with the last layer's spec; HF's layer n + k is MoE past
    first_k_dense_replace, which the export's dense-first rule makes the same."""
    return moe_layers(cfg)[cfg.num_layers - 1]


def import_mtp_layer(get, k: int, cfg: ModelConfig, interleaved: bool = True) -> dict:
    """MTP depth k (HF ``model.layers.{n+k}``) as megalite's ``mtp.layers.{k}``; the copies of the
    embedding and output layer are not read (:func:`check_mtp` compared them)."""
    p, q = f"model.layers.{cfg.num_layers + k}.", f"mtp.layers.{k}."
    out = import_block(get, p, q + "block.", _mtp_is_moe(cfg), cfg, interleaved)
    out.update({q + ours: get(p + theirs) for ours, theirs in MTP_NAMES.items()})
    return out


def export_mtp_layer(get, k: int, cfg: ModelConfig, interleaved: bool = True) -> dict:
    """megalite's ``mtp.layers.{k}`` as HF's ``model.layers.{n+k}``, with the main model's embedding
    and output layer written again as the layer's ``embed_tokens`` and ``shared_head.head``."""
    p, q = f"model.layers.{cfg.num_layers + k}.", f"mtp.layers.{k}."
    out = export_block(get, p, q + "block.", _mtp_is_moe(cfg), cfg, interleaved)
    out.update({p + theirs: get(q + ours) for ours, theirs in MTP_NAMES.items()})
    out.update({p + theirs: get(ours) for theirs, ours in _shared_copies(cfg).items()})
    return out
