"""QK-clip (``--qk-clip``, issue 39 item 5; megalite.model.qk_clip).

Fast:
- the rescale (GQA, and MLA: Kimi's per-part rule) against a float64 reference written from the equations (GQA: the
  group's max over its query heads, eta = tau / S_g, the query rows of the group eta^alpha, the
  key rows eta^(1-alpha), the value rows untouched, in the fused [q heads; k; v] per-group row
  layout), on the model's weights and the optimizer's fp32 masters, with a planted statistic;
- the per-head max each backend reports (torch, the Triton kernel under the interpreter, and the
  block functions context parallelism calls, with offsets) equals the max of the explicitly
  computed scaled q.k over the visible pairs, causal, with and without packed documents: a huge
  logit planted at a masked pair is not seen;
- below the threshold QK-clip changes nothing (bit-identical to a run without it), and the step
  with QK-clip reads nothing on the host (the value is read with the log line's one transfer);
- bad input refused in one message each;
- the rescale republishes only the buckets holding the qkv weights (stage 0, small buckets: every
  master moved, only those buckets' parameters take theirs).

Slow (one gloo world per size): TP 2, DP 2 ZeRO-1 (small buckets: the shards cut the fused qkv
weights), ZeRO-3, CP 2 (p2p, a2a and allgather) and PP 2 with a threshold low enough that the first steps
clip equal one process (losses, gradient norms 1e-6 relative, the logged max logit 1e-6; the saved
fp32 weights), and so do MLA under TP 2 and ZeRO-1; a resume from a clipped checkpoint is
bit-identical; Muon + QK-clip (MuonClip) runs and clips. Under DP 2 ZeRO-1 the rescale's
all-gather carries the bytes of the buckets holding the scaled linears (qkv; MLA's q_up and
kv_up), counted by name, not the whole model's.
"""
from __future__ import annotations

import math

import pytest
import torch

from megalite.checkpoint.format import PieceReader, resolve_checkpoint
from megalite.config import Config, ConfigError, DataConfig, ModelConfig, ParallelConfig, TrainConfig, validate
from megalite.data_parallel.update_rule import MASTER_KIND
from megalite.data_parallel.zero import DistributedOptimizer
from megalite.kernels.attention_reference import attention_block_forward
from megalite.layers.attention import attention
from megalite.layers.documents import documents_from_lengths
from megalite.model import qk_clip
from megalite.observe.host_syncs import count_host_syncs
from megalite.observe.step_values import LossScaler, resolve_steps
from megalite.parallel import comm
from megalite.parallel.grid import build_grid
from megalite.pipeline.partition import build_model_chunks
from megalite.testing import run_world
from megalite.train.step import train_step

from tests.test_zero import global_batch

HEADS, GROUPS, HIDDEN = 4, 2, 32


MLA = dict(multi_latent_attention=True, num_query_groups=None, q_lora_rank=12, kv_lora_rank=10, qk_head_dim=8,
           qk_pos_emb_head_dim=4, v_head_dim=6, normalization="RMSNorm", position_embedding_type="rope", add_bias_linear=False)


def make_config(mla: dict | None = None, **train):
    fields = dict(num_layers=2, hidden_size=HIDDEN, num_attention_heads=HEADS, num_query_groups=GROUPS,
                  vocab_size=97, seq_length=16, hidden_dropout=0.0, attention_dropout=0.0,
                  attention_backend="torch", add_qkv_bias=True)
    model = ModelConfig(**{**fields, **(mla or {})})
    t = TrainConfig(micro_batch_size=2, global_batch_size=8, lr=3e-3, weight_decay=0.1, clip_grad=1.0,
                    train_iters=3, **train)
    return Config(model, ParallelConfig(), t, DataConfig(mock_data=True))


def build(config):
    chunks = build_model_chunks(config, build_grid(config.parallel, 1, 0))
    for c in chunks:
        c.init_weights(7)
    return chunks, DistributedOptimizer(chunks, config.train, None, stage=0)


def run_steps(config, steps=2):
    chunks, opt = build(config)
    results = [train_step(chunks, opt, global_batch(config.model, s), config.train, s, LossScaler(False))
               for s in range(steps)]
    return chunks, opt, results


# -- the rescale against the equations ------------------------------------------------------------
def reference_clip(weight, bias, head_max, tau, alpha, heads, groups, d):
    """float64: rows per group [r query heads of d rows, the key head, the value head]."""
    r = heads // groups
    w = weight.double().reshape(groups, r + 2, d, -1).clone()
    b = bias.double().reshape(groups, r + 2, d).clone()
    for g in range(groups):
        s_g = max(float(head_max[g * r + i]) for i in range(r))
        eta = tau / s_g if s_g > tau else 1.0
        w[g, :r] *= eta ** alpha
        b[g, :r] *= eta ** alpha
        w[g, r] *= eta ** (1 - alpha)
        b[g, r] *= eta ** (1 - alpha)
    return w.reshape(weight.shape), b.reshape(bias.shape)


def test_the_rescale_equals_the_equations_on_weights_and_masters():
    tau, alpha = 2.0, 0.3
    config = make_config(qk_clip=True, qk_clip_threshold=tau, qk_clip_alpha=alpha)
    chunks, opt = build(config)
    parts = qk_clip.attention_parts(chunks)
    planted = [torch.tensor([5.0, 1.0, 0.5, 1.5]), torch.tensor([1.0, 8.0, 3.0, float("-inf")])]
    before = [(p.qkv.weight.detach().clone(), p.qkv.bias.detach().clone()) for p in parts]
    for p, m in zip(parts, planted):
        p.logit_max = m.clone()
    logged = qk_clip.after_step(chunks, opt, None, config.train)
    assert float(logged) == 8.0 and all(p.logit_max is None for p in parts)
    d = HIDDEN // HEADS
    masters = {n: opt.master[pl.shard][pl.start:pl.stop] for pl in opt._geometry(
        {p: n for c in chunks for n, p in c.named_parameters()}).places for n in [pl.name]}
    for (name, part), (w0, b0), m in zip([(n, p) for c in chunks for n, p in c.named_modules()
                                          if p in parts], before, planted):
        want_w, want_b = reference_clip(w0, b0, m, tau, alpha, HEADS, GROUPS, d)
        assert torch.allclose(part.qkv.weight.double(), want_w, rtol=1e-6, atol=0)
        assert torch.allclose(part.qkv.bias.double(), want_b, rtol=1e-6, atol=0)
        assert torch.equal(masters[f"{name}.qkv.weight"].view_as(w0), part.qkv.weight.detach())
    # group 1 of layer 0 stayed below tau, and so did the value rows everywhere: untouched
    r = HEADS // GROUPS
    w_after = parts[0].qkv.weight.detach().reshape(GROUPS, r + 2, d, -1)
    assert torch.equal(w_after[1], before[0][0].reshape(GROUPS, r + 2, d, -1)[1])
    assert torch.equal(w_after[:, r + 1], before[0][0].reshape(GROUPS, r + 2, d, -1)[:, r + 1])


@pytest.mark.parametrize("q_lora", [12, None])
def test_mla_rescale_equals_kimis_rule(q_lora):
    """Per head (its own key): the no-RoPE query rows eta^alpha, the RoPE query rows eta, the
    no-RoPE key rows eta^(1-alpha), values and the shared RoPE key (kv_down) unchanged."""
    tau, alpha, dn, dr, dv = 2.0, 0.3, 8, 4, 6
    config = make_config(mla={**MLA, "q_lora_rank": q_lora}, qk_clip=True, qk_clip_threshold=tau,
                         qk_clip_alpha=alpha)
    validate(config, 1)
    chunks, opt = build(config)
    parts = qk_clip.attention_parts(chunks)
    query = [p.q_up if q_lora else p.q_proj for p in parts]
    before = [(q.weight.detach().double().clone(), p.kv_up.weight.detach().double().clone(),
               p.kv_down.weight.detach().clone()) for q, p in zip(query, parts)]
    planted = [torch.tensor([5.0, 1.0, 0.5, 8.0]), torch.tensor([1.0, 3.0, float("inf"), 2.0])]
    for p, m in zip(parts, planted):
        p.logit_max = m.clone()
    qk_clip.after_step(chunks, opt, None, config.train)
    for q, p, (wq, wkv, wdown), m in zip(query, parts, before, planted):
        wq, wkv = wq.view(HEADS, dn + dr, -1).clone(), wkv.view(HEADS, dn + dv, -1).clone()
        for h in range(HEADS):
            s_h = float(m[h])
            eta = tau / s_h if math.isfinite(s_h) and s_h > tau else 1.0
            wq[h, :dn] *= eta ** alpha
            wq[h, dn:] *= eta
            wkv[h, :dn] *= eta ** (1 - alpha)
        assert torch.allclose(q.weight.double(), wq.view(q.weight.shape), rtol=1e-6, atol=0)
        assert torch.allclose(p.kv_up.weight.double(), wkv.view(p.kv_up.weight.shape), rtol=1e-6, atol=0)
        assert torch.equal(p.kv_down.weight, wdown)


# -- the republish: only the buckets holding the scaled weights ----------------------------------
def scaled_bucket_flags(opt, chunks, scaled=("qkv",)) -> list[bool]:
    """Per bucket: does it hold a parameter whose name names a scaled linear (by name, not by the
    optimizer's own lookup)?"""
    names = {p: n for c in chunks for n, p in c.named_parameters()}
    return [any(any(f".{s}." in names[p] for s in scaled) for p in b.params) for b in opt.sync.buckets]


def test_the_rescale_republishes_only_the_buckets_holding_the_query_and_key_weights():
    """Stage 0, small buckets: every master moved, then a rescale by 1 (no head clipped): the
    parameters of the buckets holding qkv take their masters, every other keeps its old weight."""
    config = make_config(qk_clip=True, qk_clip_threshold=1e6)
    chunks = build_model_chunks(config, build_grid(config.parallel, 1, 0))
    for c in chunks:
        c.init_weights(7)
    opt = DistributedOptimizer(chunks, config.train, None, stage=0, bucket_size=700)
    held = scaled_bucket_flags(opt, chunks)
    assert any(held) and not all(held)
    before = [[p.detach().clone() for p in b.params] for b in opt.sync.buckets]
    for m in opt.master:
        m.add_(1.0)
    for part in qk_clip.attention_parts(chunks):
        part.logit_max = torch.ones(part.local_heads)
    qk_clip.after_step(chunks, opt, None, config.train)
    for b, was, republished in zip(opt.sync.buckets, before, held):
        for p, w in zip(b.params, was):
            assert torch.equal(p.detach(), w + 1.0 if republished else w)


# -- the max each backend reports ----------------------------------------------------------------
def explicit_max(q, k, visible):
    """float64 max over visible pairs of q.k / sqrt(d), per query head."""
    kk = k.double().repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    scores = q.double() @ kk.transpose(-1, -2) / math.sqrt(q.shape[-1])
    return scores.masked_fill(~visible, float("-inf")).amax(dim=(0, 2, 3))


def qkv(b=2, s=24, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, HEADS, s, d, generator=g)
    k = torch.randn(b, GROUPS, s, d, generator=g)
    k[:, :, -1] *= 50  # the last key is huge: only the last query may see it (causal)
    return q, k, torch.randn(b, GROUPS, s, d, generator=g)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("packed", [False, True])
def test_backends_report_the_max_of_the_visible_scores(backend, packed):
    q, k, v = qkv()
    s = q.shape[2]
    i, j = torch.arange(s)[:, None], torch.arange(s)[None, :]
    visible = (j <= i).expand(q.shape[0], 1, s, s)
    documents = None
    if packed:  # documents end mid-sequence: a query sees only keys of its own document
        documents = documents_from_lengths([[10, 14], [5, 18, 1]])
        visible = visible & (j[None, None] >= documents.start[:, None, :, None])
    logit_max = torch.full((HEADS,), float("-inf"))
    out = attention(q, k, v, causal=True, backend=backend, documents=documents, logit_max=logit_max)
    want = explicit_max(q, k, visible)
    assert torch.allclose(logit_max.double(), want, rtol=1e-5, atol=1e-5), (logit_max, want)
    assert torch.equal(out, attention(q, k, v, causal=True, backend=backend, documents=documents))
    unmasked = explicit_max(q, k, torch.ones_like(visible))
    assert (unmasked > want + 1).all()  # the planted huge logits sit at masked pairs and were not seen


@pytest.mark.parametrize("ops", ["torch", "triton"])
def test_block_functions_write_the_row_max_with_offsets(ops):
    from megalite.kernels.flash_attention import flash_attention_forward
    forward = attention_block_forward if ops == "torch" else flash_attention_forward
    q, k, v = qkv(s=12)
    row_max = torch.empty(q.shape[:3])
    forward(q, k, v, causal=True, q_offset=12, k_offset=4, row_max=row_max)
    i, j = torch.arange(12)[:, None] + 12, torch.arange(12)[None, :] + 4
    kk = k.double().repeat_interleave(2, dim=1)
    scores = (q.double() @ kk.transpose(-1, -2) / 4.0).masked_fill(~(j <= i), float("-inf"))
    assert torch.allclose(row_max.double(), scores.amax(-1), rtol=1e-5, atol=1e-5)


# -- nothing below the threshold, no host read -----------------------------------------------------
def test_below_the_threshold_nothing_changes_and_nothing_is_read():
    plain_chunks, _, plain = run_steps(make_config())
    with count_host_syncs() as calls:
        chunks, _, clipped = run_steps(make_config(qk_clip=True, qk_clip_threshold=1e6))
    assert calls == []  # the statistic, its reduction and the rescale stay on the device
    resolve_steps(plain + clipped)
    assert [(r.loss, r.grad_norm) for r in clipped] == [(r.loss, r.grad_norm) for r in plain]
    assert all(0 < r.max_attention_logit < 1e6 for r in clipped) and plain[0].max_attention_logit is None
    for a, b in zip(plain_chunks[0].parameters(), chunks[0].parameters()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("mla", [None, MLA], ids=["gqa", "mla"])
def test_a_low_threshold_clips_every_step_to_it(mla):
    """With lr 0 (the update moves nothing) the same batch's logits after the rescale are at
    most tau, and the largest is tau: the clipped heads land on it."""
    tau = 0.01
    config = make_config(mla, qk_clip=True, qk_clip_threshold=tau)
    config.train.lr = 0.0
    chunks, opt, results = run_steps(config, steps=1)
    assert results[0].max_attention_logit > 2 * tau
    qk_clip.start_step(chunks, config.train)
    with torch.no_grad():
        for b in global_batch(config.model, 0):
            chunks[0](b["tokens"], b["position_ids"], labels=b["labels"])
    assert abs(max(float(p.logit_max.max()) for p in qk_clip.attention_parts(chunks)) - tau) < 1e-6


# -- bad input -------------------------------------------------------------------------------------
@pytest.mark.parametrize("change, words", [
    (dict(qk_clip_threshold=0.0), "--qk-clip-threshold must be > 0"),
    (dict(qk_clip_alpha=1.0), "--qk-clip-alpha must be in (0, 1)"),
    (dict(model=dict(attention_backend="flash")), "--attention-backend flash"),
    (dict(model=dict(qk_layernorm=True)), "--qk-layernorm"),
    (dict(model=dict(transformer_impl="transformer_engine")), "--transformer-impl"),
])
def test_bad_input_is_refused_once(change, words):
    change = dict(change)
    config = make_config(qk_clip=True, **{k: v for k, v in change.items() if k != "model"})
    for k, v in change.get("model", {}).items():
        setattr(config.model, k, v)
    with pytest.raises(ConfigError) as info:
        validate(config, 1)
    assert words in str(info.value) and "Fix:" in str(info.value)


# -- every layout equals one process (slow) --------------------------------------------------------
BASE = ["--mock-data", "--vocab-size", "128", "--num-layers", "2", "--hidden-size", "32",
        "--num-attention-heads", "4", "--num-query-groups", "2", "--seq-length", "16",
        "--max-position-embeddings", "16", "--micro-batch-size", "2", "--global-batch-size", "4",
        "--lr", "1e-2", "--train-iters", "3", "--log-interval", "100", "--clip-grad", "1.0",
        "--hidden-dropout", "0", "--attention-dropout", "0", "--attention-backend", "torch",
        "--normalization", "RMSNorm", "--position-embedding-type", "rope", "--swiglu",
        "--disable-bias-linear", "--adam-eps", "1e-4", "--qk-clip", "--qk-clip-threshold", "0.03"]
TOL = 1e-6
# The fp32 weights after 3 steps, relative to the tensor's largest element: Adam's update of an
# element whose gradient is near zero turns on rounding (with eps 1e-8, TP 2 without QK-clip
# already differed by 4e-4 here); with eps 1e-4 the layouts agree to ~6e-6 (the word embedding).
WEIGHT_TOL = 2e-5


def _pretrain(argv):
    from megalite.train.pretrain import pretrain
    return [(r["iteration"], r["loss"], r["grad_norm"], r.get("max_attention_logit")) for r in pretrain(argv)]


def _serial(rank, world, root):
    return {"serial": _pretrain(BASE + ["--save", f"{root}/serial"]),
            "noclip": _pretrain([a for a in BASE if a != "--qk-clip"] + ["--log-max-attention-logit",
                                                                        "--save", f"{root}/noclip"]),
            "muon": _pretrain(BASE + ["--optimizer", "muon", "--save", f"{root}/muon"]),
            "muon_noclip": _pretrain([a for a in BASE if a != "--qk-clip"] + ["--optimizer", "muon",
                                                                             "--save", f"{root}/muon_noclip"]),
            "mla": _pretrain(MLA_BASE + ["--save", f"{root}/mla"]),
            "half": _pretrain([("2" if before == "--train-iters" else a) for before, a in zip([None] + BASE, BASE)]
                              + ["--lr-decay-iters", "3", "--save", f"{root}/half"]),
            "resumed": _pretrain(BASE + ["--load", f"{root}/half", "--save", f"{root}/resumed"])}


LAYOUTS = {"tp2": ["--tensor-model-parallel-size", "2"],
           "zero1": ["--zero-stage", "1", "--ddp-bucket-size", "700"],
           "zero3": ["--zero-stage", "3"],
           "cp2p2p": ["--context-parallel-size", "2", "--cp-comm-type", "p2p"],
           "cp2a2a": ["--context-parallel-size", "2", "--cp-comm-type", "a2a"],
           "cp2allgather": ["--context-parallel-size", "2", "--cp-comm-type", "allgather"],
           "pp2": ["--pipeline-model-parallel-size", "2"]}
MLA_FLAGS = ["--multi-latent-attention", "--q-lora-rank", "12", "--kv-lora-rank", "10", "--qk-head-dim", "8",
             "--qk-pos-emb-head-dim", "4", "--v-head-dim", "6"]
_GROUPS_AT = BASE.index("--num-query-groups")
# MLA has no KV groups; its logits are smaller here, so its threshold is lower
MLA_BASE = [("0.01" if a == "0.03" else a) for a in BASE[:_GROUPS_AT] + BASE[_GROUPS_AT + 2:]] + MLA_FLAGS
MLA_LAYOUTS = {"mla_tp2": ["--tensor-model-parallel-size", "2"], "mla_zero1": ["--zero-stage", "1",
                                                                              "--ddp-bucket-size", "300"]}


def _republish_bytes(rank, world, mla):
    """DP 2 ZeRO-1, small buckets, a planted statistic above tau: (bytes the rescale's publish
    hands the all-gather, the scaled linears' buckets' bytes, one full publish's bytes)."""
    config = make_config(mla, qk_clip=True, qk_clip_threshold=0.5)
    grid = build_grid(config.parallel, world, rank)
    chunks = build_model_chunks(config, grid)
    for c in chunks:
        c.init_weights(7)
    opt = DistributedOptimizer(chunks, config.train, grid, stage=1, bucket_size=300 if mla else 700)
    for part in qk_clip.attention_parts(chunks):
        part.logit_max = torch.full((part.local_heads,), 4.0)
    with comm.count_collectives() as rescale:
        qk_clip.after_step(chunks, opt, grid, config.train)
    with comm.count_collectives() as full:
        opt.publish()
    held = scaled_bucket_flags(opt, chunks, ("q_up", "kv_up") if mla else ("qkv",))
    scaled = sum(b.numel * 4 for b, h in zip(opt.sync.buckets, held) if h)  # fp32 weights here
    return rescale["all_gather"]["bytes"], scaled, full["all_gather"]["bytes"]


def _two_ranks(rank, world, root):
    republish = {"gqa": _republish_bytes(rank, world, None), "mla": _republish_bytes(rank, world, MLA)}
    runs = {name: _pretrain(BASE + extra + ["--save", f"{root}/{name}"]) for name, extra in LAYOUTS.items()}
    runs.update({name: _pretrain(MLA_BASE + extra + ["--save", f"{root}/{name}"])
                 for name, extra in MLA_LAYOUTS.items()})
    return runs, republish


def _weights(path) -> dict[str, torch.Tensor]:
    reader = PieceReader(resolve_checkpoint(str(path)))
    return {n: reader.full_tensor(n, MASTER_KIND, 128) for n in reader.names(MASTER_KIND)}


def _close(a, b, name):
    """Losses and gradient norms 1e-6 relative; the max logit (~0.05 here, a sum of products of
    O(1) terms, rounded in another order) 1e-6 absolute."""
    assert [x[0] for x in a] == [x[0] for x in b]
    for x, y in zip(a, b):
        assert all(abs(u - w) <= TOL * abs(w) for u, w in zip(x[1:3], y[1:3])), (name, x, y)
        assert abs(x[3] - y[3]) <= TOL, (name, x, y)


@pytest.mark.slow
def test_every_layout_with_qk_clip_equals_one_process(tmp_path):
    serial = run_world(_serial, 1, str(tmp_path))[0]
    assert [m > 0.03 for *_, m in serial["serial"]] == [True, True, False]  # it fires, then holds
    assert serial["noclip"][0] == serial["serial"][0]  # the first step's forward is the same; only logged
    clipped, plain = _weights(tmp_path / "serial"), _weights(tmp_path / "noclip")
    assert any(not torch.equal(clipped[n], plain[n]) for n in clipped if "qkv" in n)
    assert serial["resumed"] == serial["serial"][2:]  # a resume from the clipped masters is exact
    assert all(torch.equal(w, clipped[n]) for n, w in _weights(tmp_path / "resumed").items())
    muon, muon_plain = _weights(tmp_path / "muon"), _weights(tmp_path / "muon_noclip")  # MuonClip clips
    assert any(not torch.equal(muon[n], muon_plain[n]) for n in muon if "qkv" in n)
    runs, republish = run_world(_two_ranks, 2, str(tmp_path))[0]
    assert serial["mla"][0][3] > 0.01  # MLA clips too (its threshold 0.01)
    mla = _weights(tmp_path / "mla")
    for name, baseline, weights in [(n, serial["serial"], clipped) for n in LAYOUTS] + [
            (n, serial["mla"], mla) for n in MLA_LAYOUTS]:
        _close(runs[name], baseline, name)
        saved = _weights(tmp_path / name)
        assert saved.keys() == weights.keys()
        worst = max(((saved[n] - weights[n]).abs().max() / weights[n].abs().max()).item() for n in saved)
        assert worst < WEIGHT_TOL, (name, worst)
    for kind, (handed, scaled, everything) in republish.items():  # the rescale's all-gather: those buckets
        assert 0 < handed == scaled < everything, (kind, handed, scaled, everything)
