"""DeepSeek-V3 routing against float64 references written from the equations, one token at a time
(megalite.moe.scoring, megalite.moe.balancing): sigmoid scores, group-limited top-k (a group's
score = the sum of its two best biased scores), normalised weights times the routed scaling
factor, the expert bias steering the choice only, and the bias update
``b += rate * sign(mean load - load)``. Also: softmax stays what it was, the bad settings, the
``--moe-layer-freq`` pattern, and the bias balancing a skewed router without any aux loss."""
import math

import pytest
import torch

from megalite.config import Config, ConfigError, DataConfig, ModelConfig, ParallelConfig, TrainConfig, validate
from megalite.moe.balancing import bias_step, update_expert_biases
from megalite.moe.layer import MoELayer
from megalite.moe.router import TopKRouter
from megalite.moe.settings import moe_layers, parse_layer_freq


def reference_route(logits, k, score="softmax", bias=None, groups=None, group_topk=None, factor=None):
    """float64, per token, from the equations: [(sorted expert ids, {expert: weight})]."""
    out = []
    E = len(logits[0])
    for row in logits:
        row = [float(v) for v in row]
        if score == "softmax":
            z = sum(math.exp(v) for v in row)
            s = [math.exp(v) / z for v in row]
        else:
            s = [1.0 / (1.0 + math.exp(-v)) for v in row]
        sel = [s[e] + (float(bias[e]) if bias is not None else 0.0) for e in range(E)]
        allowed = list(range(E))
        if groups:
            n = E // groups
            group_score = []
            for g in range(groups):
                members = sorted((sel[e] for e in range(g * n, (g + 1) * n)), reverse=True)
                group_score.append(sum(members[:2]))
            kept = sorted(range(groups), key=lambda g: -group_score[g])[:group_topk]
            allowed = [e for e in range(E) if e // n in kept]
        chosen = sorted(allowed, key=lambda e: -sel[e])[:k]
        total = sum(s[e] for e in chosen)
        w = {e: (s[e] / total if k > 1 else s[e]) * (factor if factor is not None else 1.0) for e in chosen}
        out.append((sorted(chosen), w))
    return out


CASES = {
    "softmax": dict(score_function="softmax"),
    "sigmoid": dict(score_function="sigmoid"),
    "sigmoid, scaled": dict(score_function="sigmoid", scaling_factor=2.5),
    "sigmoid, 4 groups keep 2": dict(score_function="sigmoid", num_groups=4, group_topk=2, scaling_factor=2.5),
    "softmax, 2 groups keep 1": dict(score_function="softmax", num_groups=2, group_topk=1),
    "sigmoid, groups + bias": dict(score_function="sigmoid", num_groups=4, group_topk=2, expert_bias=True),
}


@pytest.mark.parametrize("name", list(CASES))
def test_routing_matches_float64_reference(name):
    options = CASES[name]
    torch.manual_seed(3)
    T, h, E, k = 64, 16, 8, 3
    router = TopKRouter(h, E, k, **options)
    with torch.no_grad():
        router.weight.normal_(0, 0.5)
        if options.get("expert_bias"):
            router.expert_bias.copy_(torch.linspace(-0.3, 0.4, E))
    x = torch.randn(T, h)
    r = router(x)
    logits = (x.double() @ router.weight.double().T).tolist()
    ref = reference_route(logits, k, options["score_function"],
                          router.expert_bias.tolist() if options.get("expert_bias") else None,
                          options.get("num_groups"), options.get("group_topk"), options.get("scaling_factor"))
    for t, (ids, weights) in enumerate(ref):
        got = r.expert_ids[t].tolist()
        assert sorted(got) == ids, (t, got, ids)
        for j, e in enumerate(got):
            assert abs(r.weights[t, j].item() - weights[e]) < 1e-6, (t, e, r.weights[t, j].item(), weights[e])
    if options.get("num_groups"):  # every token's experts within group_topk groups
        n = E // options["num_groups"]
        assert max(len({e // n for e in row}) for row in r.expert_ids.tolist()) <= options["group_topk"]


def test_bias_steers_the_choice_not_the_weights():
    """A large bias on expert 0 puts it in every token's top-k; its weight stays its score's share."""
    torch.manual_seed(0)
    router = TopKRouter(16, 8, 2, score_function="sigmoid", expert_bias=True)
    with torch.no_grad():
        router.weight.normal_(0, 0.5)
        router.expert_bias[0] = 10.0
    x = torch.randn(32, 16)
    r = router(x)
    assert (r.expert_ids == 0).any(dim=1).all()
    scores = torch.sigmoid(x.double() @ router.weight.double().T)
    chosen = scores.gather(1, r.expert_ids)
    torch.testing.assert_close(r.weights.double(), chosen / chosen.sum(1, keepdim=True), atol=1e-6, rtol=0)


def test_softmax_default_is_unchanged():
    """The default router: softmax -> topk -> / sum, bit for bit, and no bias buffer in its state."""
    torch.manual_seed(1)
    router = TopKRouter(16, 8, 2)
    router.weight.data.normal_(0, 0.5)
    x = torch.randn(40, 16)
    r = router(x)
    top_p, ids = torch.nn.functional.linear(x, router.weight).softmax(-1).topk(2, dim=-1)
    assert torch.equal(r.expert_ids, ids) and torch.equal(r.weights, top_p / top_p.sum(-1, keepdim=True))
    assert list(router.state_dict()) == ["weight"]


def test_bias_update_matches_reference_and_stays_fp32():
    counts = torch.tensor([5, 0, 3, 3, 9, 4, 3, 5])  # mean 4
    bias = torch.linspace(-1, 1, 8)
    want = [float(b) + 1e-3 * (1 if 4.0 - n > 0 else -1 if 4.0 - n < 0 else 0) for b, n in zip(bias.tolist(), counts)]
    got = bias.clone()
    bias_step(got, counts, 1e-3)
    assert max(abs(a - b) for a, b in zip(got.tolist(), want)) < 1e-7
    layer = MoELayer(16, 8, 8, 2, routing=dict(score_function="sigmoid", expert_bias=True))
    layer.router.expert_bias.fill_(1 + 1e-3)  # not a bf16 number
    layer = layer.to(torch.bfloat16)
    assert layer.router.expert_bias.dtype == torch.float32 and "router.expert_bias" in layer.state_dict()
    assert torch.equal(layer.router.expert_bias, torch.full((8,), 1 + 1e-3))


def _skewed_run(bias: bool, steps: int, tokens: int = 4096, E: int = 8, k: int = 2, rate: float = 5e-3):
    """An MoE layer whose router favours experts 0 and 1 (their rows + 1.5 along a direction every
    token shares), trained by SGD on a regression, no aux loss: max/mean expert load per step."""
    torch.manual_seed(0)
    layer = MoELayer(32, 16, E, k, routing=dict(score_function="sigmoid", expert_bias=bias))
    layer.init_weights(seed=5, std=0.1)
    direction = torch.randn(32)
    direction /= direction.norm()
    with torch.no_grad():
        layer.router.weight[:2] += 1.5 * direction
    target = torch.nn.Linear(32, 32, bias=False)
    opt = torch.optim.SGD(layer.parameters(), lr=0.05)
    layer.train()
    loads = []
    for _ in range(steps):
        x = torch.randn(tokens, 32) + direction
        layer.reset_stats()
        out, _ = layer(x)
        loss = (out - target(x).detach()).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        load = layer.stat_tokens.float()
        loads.append((load.max() / load.mean()).item())
        update_expert_biases([layer], rate)
    return loads


def test_expert_bias_balances_a_skewed_router_without_aux_loss():
    """docs/moe.md: 4,096 tokens a step, 8 experts top-2, sigmoid, rate 5e-3, no aux loss: from a
    max/mean load near 2.9 the bias brings it below 1.2 within 40 steps, and it stays below up to
    step 60; without the bias the two favoured experts keep it above 2.5 for all 60 steps."""
    steps, within = 60, 40
    with_bias, without = _skewed_run(True, steps), _skewed_run(False, steps)
    assert with_bias[0] > 2.5 and without[0] > 2.5, (with_bias[0], without[0])  # skewed at the start
    first = next(i for i, load in enumerate(with_bias) if load < 1.2)
    assert first < within and max(with_bias[first:]) < 1.2, with_bias
    assert min(without) > 2.5, without


def _validate(**moe):
    model = ModelConfig(num_layers=4, hidden_size=32, num_attention_heads=4, seq_length=16, vocab_size=97,
                        **{"num_experts": 8, **moe})
    validate(Config(model, ParallelConfig(), TrainConfig(micro_batch_size=1), DataConfig(mock_data=True)), 1)


BAD = [
    (dict(moe_router_num_groups=3, moe_router_group_topk=1),
     "--moe-router-num-groups 3 does not divide --num-experts 8"),
    (dict(moe_router_num_groups=4, moe_router_group_topk=5),
     "--moe-router-group-topk 5 must be in [1, --moe-router-num-groups 4]"),
    (dict(moe_router_num_groups=4, moe_router_group_topk=1, moe_router_topk=3),
     "--moe-router-topk 3 exceeds the 2 experts of the kept groups"),
    (dict(moe_router_num_groups=4), "group-limited routing needs both"),
    (dict(moe_router_topk_scaling_factor=0.0), "--moe-router-topk-scaling-factor 0.0 must be positive"),
    (dict(moe_router_bias_update_rate=-1e-3), "--moe-router-bias-update-rate -0.001 must be >= 0"),
]


@pytest.mark.parametrize("kwargs,message", BAD, ids=[m[:30] for _, m in BAD])
def test_bad_routing_settings_are_refused(kwargs, message):
    with pytest.raises(ConfigError) as e:
        _validate(**kwargs)
    assert message in str(e.value) and "Fix:" in str(e.value)


def test_deepseek_settings_pass_and_layer_freq_pattern():
    _validate(moe_router_score_function="sigmoid", moe_router_num_groups=4, moe_router_group_topk=2,
              moe_router_topk_scaling_factor=2.5, moe_router_enable_expert_bias=True, moe_layer_freq="([0]*1+[1]*3)")
    assert parse_layer_freq("([0]*3+[1]*58)") == [0] * 3 + [1] * 58
    assert parse_layer_freq("'([1]*2+[0])*2'") == [1, 1, 0, 1, 1, 0]
    assert parse_layer_freq("[0]*1+[1]*2") == [0, 1, 1]
    model = ModelConfig(num_layers=4, hidden_size=32, num_attention_heads=4, num_experts=8,
                        moe_layer_freq=parse_layer_freq("([0]*2+[1]*2)"))
    assert moe_layers(model) == [False, False, True, True]
    for bad in ("([0]*3+", "[1]*[1]", "[0]*2+[1]*x"):
        with pytest.raises(ConfigError):
            parse_layer_freq(bad)


def test_counting_knows_dense_first_layers_and_shared_experts():
    """model/counting.py's arithmetic against the built (meta) model, DeepSeek-V3-shaped: the
    first layer dense (FFN 96), then 8 experts of 16 + a shared expert of 32, top-2."""
    from megalite.model import counting
    from megalite.model.gpt import count_parameters

    cfg = ModelConfig(num_layers=4, hidden_size=32, num_attention_heads=4, seq_length=16, vocab_size=97,
                      ffn_hidden_size=96, swiglu=True, add_bias_linear=False, normalization="RMSNorm",
                      position_embedding_type="rope", num_experts=8, moe_router_topk=2, moe_ffn_hidden_size=16,
                      moe_shared_expert_intermediate_size=32, moe_layer_freq=parse_layer_freq("([0]*1+[1]*3)"),
                      moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True)
    built = count_parameters(cfg)
    assert counting.total_parameters(cfg) == built
    expert = 3 * 32 * 16  # SwiGLU: gate, up, down
    assert counting.active_parameters(cfg) == built - 3 * (8 - 2) * expert
    dense_mlp, shared_mlp = 3 * 32 * 96, 3 * 32 * 32
    every_moe = ModelConfig(**{**cfg.__dict__, "moe_layer_freq": 1})
    assert count_parameters(every_moe) - built == (8 * expert + shared_mlp + 8 * 32) - dense_mlp  # + router


def test_deepseek_flags_reach_the_config():
    from megalite.arguments import build_parser, config_from_args

    args = build_parser().parse_args(
        ["--mock-data", "--num-layers", "4", "--num-experts", "8", "--moe-router-topk", "2",
         "--moe-router-score-function", "sigmoid", "--moe-router-num-groups", "4", "--moe-router-group-topk", "2",
         "--moe-router-topk-scaling-factor", "2.5", "--moe-router-enable-expert-bias",
         "--moe-router-bias-update-rate", "0.01", "--moe-layer-freq", "([0]*1+[1]*3)"])
    config = config_from_args(args, vocab_size=100)
    validate(config, 1)
    m = config.model
    assert (m.moe_router_score_function, m.moe_router_num_groups, m.moe_router_group_topk,
            m.moe_router_topk_scaling_factor, m.moe_router_enable_expert_bias,
            m.moe_router_bias_update_rate) == ("sigmoid", 4, 2, 2.5, True, 0.01)
    assert moe_layers(m) == [False, True, True, True]
    defaults = config_from_args(build_parser().parse_args(["--mock-data"]), vocab_size=100).model
    assert (defaults.moe_router_score_function, defaults.moe_router_num_groups, defaults.moe_router_enable_expert_bias,
            defaults.moe_router_bias_update_rate) == ("softmax", None, False, 1e-3)


def test_routing_and_the_bias_update_read_nothing_on_the_host():
    """Sigmoid group-limited routing with the bias, the load count and the bias update: no host
    read (megalite.observe.host_syncs counts every read made from megalite's code)."""
    from megalite.observe.host_syncs import count_host_syncs

    layer = MoELayer(16, 8, 8, 2, routing=dict(score_function="sigmoid", num_groups=4, group_topk=2,
                                               scaling_factor=2.5, expert_bias=True))
    layer.init_weights(seed=1)
    layer.train()
    x = torch.randn(32, 16)
    with count_host_syncs() as calls:
        layer._record(layer.router(x))
        update_expert_biases([layer], 1e-3)
    assert calls == [], calls
    assert layer.router.expert_bias.abs().sum() > 0 and layer.router.bias_tokens.sum() == 0
