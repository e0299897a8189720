"""Multi-token prediction (``--mtp-num-layers``, DeepSeek-V3 section 2.2; megalite.model.mtp).

The loss is checked against a float64 reference written from the paper's equations, not from
megalite's MTP code: with the token stream x_0..x_s of a row (inputs x_0..x_{s-1}, labels x_1..x_s),

    h_0 = the main model's normalised last hidden state;  L_main = masked mean of CE(Out h_0[t], x_{t+1})
    h_k[t] = RMSNorm_k(Block_k(W_k [RMSNorm(Emb x_{t+k}); RMSNorm(h_{k-1}[t])]))
    L_k = masked mean over t of CE(Out h_k[t], x_{t+k+1}),  mask: loss_mask[t+k], t+k+1 <= s, and
          t, t+k in one document (document ids from the packed lengths)
    L = L_main + lambda / D * sum_k L_k

Emb and Out are matrices read from the model; the transformer layer Block_k (tested on its own
elsewhere) and the main model's h_0 are called as functions in float64. Every layout equals serial:
tests/test_mtp_layouts.py.
"""
from __future__ import annotations

import copy

import pytest
import torch

from megalite.config import Config, ConfigError, DataConfig, ModelConfig, ParallelConfig, TrainConfig, validate
from megalite.layers.documents import documents_from_lengths
from megalite.layers.rotary import rotary_angles
from megalite.model.counting import flops_per_token, mtp_parameters, total_parameters
from megalite.model.gpt import GPTModel, count_parameters
from megalite.model.mtp import MTPLosses, shifted_targets, with_mtp_targets
from megalite.train.step import stage_loss

V, S, EPS, LAMBDA, D = 50, 12, 1e-6, 0.3, 2


def mtp_config(**kw) -> ModelConfig:
    fields = dict(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, vocab_size=V,
                  seq_length=S, position_embedding_type="rope", normalization="RMSNorm", norm_epsilon=EPS,
                  swiglu=True, add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0,
                  untie_embeddings_and_output_weights=True, mtp_num_layers=D, mtp_loss_scaling_factor=LAMBDA)
    return ModelConfig(**{**fields, **kw})


def rms(t, w):
    return w * t / torch.sqrt((t * t).mean(-1, keepdim=True) + EPS)


def cross_entropy(h, out, targets):
    """-log softmax(out h)[target] per position, h (s, b, d) -> (b, s)."""
    logp = torch.log_softmax(h @ out.T, -1)
    return -logp.gather(-1, targets.t().unsqueeze(-1)).squeeze(-1).t()


def reference(model, stream, loss_mask, lengths):
    """The loss of the module docstring in float64 (a float64 copy of ``model``), and each depth's."""
    model = copy.deepcopy(model).double()
    tokens, labels = stream[:, :-1], stream[:, 1:]
    b, s = tokens.shape
    docs = documents_from_lengths(lengths)
    captured = {}
    model.final_norm.register_forward_hook(lambda mod, inp, out: captured.update(h0=out))
    model(tokens, labels=labels, documents=docs)
    emb = model.word_embeddings.weight[:V]
    out = model.output_layer.weight[:V] if model.cfg.untie_embeddings_and_output_weights else emb
    doc_id = torch.tensor([[i for i, n in enumerate(row) for _ in range(n)] for row in lengths])
    positions = torch.arange(s)
    rope = rotary_angles(positions.expand(b, s), model.cfg.rotary_dim, model.cfg.rotary_base)

    def masked_mean(ce, m):
        return (ce * m).sum() / m.sum()

    h = captured["h0"]
    main = masked_mean(cross_entropy(h, out, labels), loss_mask.double())
    depths = []
    for k in range(1, D + 1):
        layer = model.mtp.layers[str(k - 1)]
        ahead = torch.clamp(positions + k, max=s)  # x_{t+k}; past the end: any token (masked)
        e = emb[stream[:, ahead]].transpose(0, 1)  # (s, b, h)
        u = torch.cat([rms(e, layer.enorm.weight), rms(h, layer.hnorm.weight)], -1) @ layer.eh_proj.weight.T
        h = rms(layer.block(u, rope, None, docs), layer.final_norm.weight)
        target = stream[:, torch.clamp(positions + k + 1, max=s)]
        valid = positions + k + 1 <= s
        m = torch.zeros(b, s, dtype=torch.float64)
        m[:, valid] = loss_mask[:, positions[valid] + k].double()
        m[:, valid] *= (doc_id[:, positions[valid]] == doc_id[:, positions[valid] + k]).double()
        depths.append(masked_mean(cross_entropy(h, out, target), m))
    depths = torch.stack(depths)
    return main + LAMBDA / D * depths.sum(), depths


@pytest.mark.parametrize("untied", [True, False])
def test_loss_equals_a_float64_reference_from_the_equations(untied):
    """Two depths, packed documents and a loss mask with holes: megalite's fp32 loss (the model,
    then the train step's loss rule) within 1e-6 of the float64 reference; each depth's too."""
    torch.manual_seed(0)
    model = GPTModel(mtp_config(untie_embeddings_and_output_weights=untied))
    model.init_weights(7)
    stream = torch.randint(0, V, (2, S + 1))
    loss_mask = torch.ones(2, S)
    loss_mask[0, 3] = loss_mask[1, 9] = 0
    lengths = [[5, 7], [12]]
    docs = documents_from_lengths(lengths)
    batch = {"tokens": stream[:, :-1], "labels": stream[:, 1:], "loss_mask": loss_mask,
             "doc_start": docs.start, "doc_end": docs.end}
    batch = with_mtp_targets(batch, D)
    out = model(batch["tokens"], labels=batch["labels"], documents=docs, mtp_labels=batch["mtp_labels"])
    assert isinstance(out, MTPLosses) and out.mtp.shape == (2, S, D)
    record = []
    loss = stage_loss(out, batch, record)
    want, want_depths = reference(model, stream, loss_mask, lengths)
    assert abs(loss.item() - want.item()) / want.item() < 1e-6, (loss.item(), want.item())
    assert torch.allclose(record[0][1].double(), want_depths.mean(), rtol=1e-6)
    loss.backward()
    assert model.mtp.layers["1"].eh_proj.weight.grad.abs().sum() > 0


def test_shifted_targets_stop_at_the_sequence_and_document_ends():
    labels = torch.tensor([[10, 11, 12, 13, 14, 15]])
    mask = torch.tensor([[1, 1, 1, 0, 1, 1]])
    docs = documents_from_lengths([[4, 2]])
    targets, masks = shifted_targets(labels, mask, 2, docs)
    assert targets[0, :, 0].tolist() == [11, 12, 13, 14, 15, 0]
    assert targets[0, :, 1].tolist() == [12, 13, 14, 15, 0, 0]
    # depth 1: t+1 inside t's document [0, 4) or [4, 6), and its label trained
    assert masks[0, :, 0].tolist() == [1, 1, 0, 0, 1, 0]
    assert masks[0, :, 1].tolist() == [1, 0, 0, 0, 0, 0]


def test_names_and_counts():
    """The depths' parameters have layout-free global names; the counting (planner, MFU) holds
    the built model's parameters to the element, with an MoE last layer too; FLOPs add each
    depth's parameters, attention and extra output logits."""
    cfg = mtp_config()
    names = [n for n, _ in GPTModel(cfg).named_parameters() if n.startswith("mtp.")]
    assert names[:4] == ["mtp.layers.0.enorm.weight", "mtp.layers.0.hnorm.weight", "mtp.layers.0.eh_proj.weight",
                         "mtp.layers.0.block.attn_norm.weight"]
    assert names[-1] == "mtp.layers.1.final_norm.weight"
    for kw in ({}, {"untie_embeddings_and_output_weights": False},
               {"num_experts": 4, "moe_layer_freq": [0, 1], "moe_shared_expert_intermediate_size": 16}):
        m = mtp_config(**kw)
        assert total_parameters(m) == count_parameters(m), kw
    plain = mtp_config(mtp_num_layers=None)
    assert total_parameters(cfg) - total_parameters(plain) == sum(mtp_parameters(cfg))
    h = cfg.hidden_size
    per_depth = sum(mtp_parameters(cfg)) // D
    attention = 2 * 2 * cfg.num_attention_heads * cfg.head_dim  # Q K^T and P V per attended position
    assert flops_per_token(cfg) - flops_per_token(plain) == pytest.approx(
        D * (6 * (per_depth + V * h) + 3 * attention * S))


@pytest.mark.parametrize("kw, match", [
    ({"mtp_num_layers": -1}, "--mtp-num-layers must be in"),
    ({"mtp_num_layers": S}, "--mtp-num-layers must be in"),
    ({"mtp_loss_scaling_factor": -0.1}, "--mtp-loss-scaling-factor must be >= 0"),
    ({"position_embedding_type": "learned_absolute"}, "needs --position-embedding-type rope"),
    ({"transformer_impl": "transformer_engine"}, "--mtp-num-layers is built from megalite's own layers"),
])
def test_bad_settings_get_one_message(kw, match):
    config = Config(mtp_config(**kw), ParallelConfig(), TrainConfig(), DataConfig(mock_data=True))
    with pytest.raises(ConfigError, match=match):
        validate(config, 1)


@pytest.mark.slow  # 2.6 s: the fast tier keeps under 2 s of this file
def test_planner_weights_match_the_meta_dry_run():
    """TP 2 + SP x PP 2 x DP 2 (ZeRO-1) on meta, untied, two MTP depths: the weights the planner
    counts on each stage (the last one: the depths and the copy of the word embedding they read)
    are the model's to the byte; the activations it plans are within 10% of the dry run's."""
    from tests.test_seam_attention import DRY, _planned_and_measured

    flags = DRY + ["--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu",
                   "--untie-embeddings-and-output-weights", "--mtp-num-layers", "2"]
    for role in _planned_and_measured(flags, "self")[1]:
        assert role["categories"]["parameters"] == role["planned_categories"]["weights"], role["role"]
        measured, planned = role["categories"]["activations"], role["planned_categories"]["activations"]
        assert abs(measured - planned) / planned < 0.1, (role["role"], measured, planned)


def test_an_moe_depth_joins_the_moe_step():
    """A depth of an MoE model is an MoE layer (the last layer's spec) with its own expert bias; the
    step gives its aux losses the main loss's backward scale and counts its loads in the statistics."""
    from megalite.moe.balancing import biased_layers
    from megalite.moe.stats import moe_modules, start_step

    cfg = mtp_config(num_experts=4, moe_layer_freq=[0, 1], moe_router_enable_expert_bias=True,
                     moe_aux_loss_coeff=0.01)
    model = GPTModel(cfg)
    depth = model.mtp.layers["0"].block.mlp
    assert [i for i, _ in moe_modules([model])] == [1, 2, 3] and len(biased_layers([model])) == 3
    start_step([model], 0.25)
    assert depth.backward_scale == 0.25


def test_zero_depths_is_off():
    """Megatron's off values: None (the default) and 0 build no depths and return plain losses."""
    for off in (None, 0):
        cfg = mtp_config(mtp_num_layers=off)
        assert validate(Config(cfg, ParallelConfig(), TrainConfig(), DataConfig(mock_data=True)), 1) == []
        model = GPTModel(cfg)
        tokens = torch.randint(0, V, (1, S))
        assert model.mtp is None and model(tokens, labels=tokens).shape == (1, S)
