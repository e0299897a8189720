"""A DeepSeek-V3-tiny MoE GPT (first layer dense, then sigmoid routing over 4 groups of 2 experts
keeping 2 groups, routed scaling factor, a shared expert, aux-loss-free expert bias, no aux loss)
trained 6 steps under EP2 x DP4, TP2 (SP) x EP2 x DP2 ZeRO-1, DP4 ZeRO-1, PP2 x EP2 and
CP2 x EP2 x DP2 ZeRO-1 in one gloo world of 4, against the single-process run: losses and
gradient norms to 1e-5, and the expert biases bit-identical to serial's (the global batch's
loads, all-reduced over each stage); the biases also survive a checkpoint saved at EP2 and
loaded at TP2 x EP2, into one process (both formats) and through tools/reshard_checkpoint.py
(PP2, and to torch_dcp)."""
import pytest
import os
import sys

import torch

from megalite.checkpoint.core import load_checkpoint, save_checkpoint
from megalite.checkpoint.dcp import load_dcp_checkpoint, save_dcp_checkpoint
from megalite.checkpoint.dcp_offline import load_dcp_serial_model
from megalite.checkpoint.serial import load_serial_model
from megalite.config import Config, DataConfig, ModelConfig, ParallelConfig, TrainConfig
from megalite.data_parallel.zero import DistributedOptimizer
from megalite.model.gpt import GPTModel
from megalite.parallel.grid import build_grid
from megalite.pipeline.partition import build_model_chunks
from megalite.testing import run_world
from megalite.testing.reference_step import build_optimizer, train_step
from megalite.train.step import LossScaler

from tests.test_zero import GLOBAL, MICRO, global_batch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))
import reshard_checkpoint  # noqa: E402

STEPS, TOL = 6, 1e-5
DEEPSEEK = dict(num_experts=8, moe_router_topk=2, moe_ffn_hidden_size=16, moe_layer_freq=[0, 1],
                moe_shared_expert_intermediate_size=16, moe_router_score_function="sigmoid",
                moe_router_num_groups=4, moe_router_group_topk=2, moe_router_topk_scaling_factor=2.5,
                moe_router_enable_expert_bias=True, moe_router_bias_update_rate=1e-2,
                moe_aux_loss_coeff=0.0, moe_router_load_balancing_type="none")
LAYOUTS = {"EP2 x DP4": (dict(ep=2), 0), "TP2 (SP) x EP2 x DP2 ZeRO-1": (dict(tp=2, ep=2), 1),
           "DP4 ZeRO-1": (dict(), 1), "PP2 x EP2": (dict(pp=2, ep=2), 0), "CP2 x EP2 x DP2": (dict(cp=2, ep=2), 1)}


def make_config(tp=1, pp=1, ep=1, cp=1):
    model = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=97, seq_length=16,
                        hidden_dropout=0.0, attention_dropout=0.0, add_bias_linear=False, swiglu=True,
                        normalization="RMSNorm", position_embedding_type="rope", **DEEPSEEK)
    t = TrainConfig(micro_batch_size=MICRO, global_batch_size=GLOBAL, lr=3e-3, weight_decay=0.1, clip_grad=0.5,
                    train_iters=STEPS, adam_eps=1e-5)
    parallel = ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, sequence_parallel=tp > 1,
                              context_parallel_size=cp, expert_model_parallel_size=ep)
    return Config(model, parallel, t, DataConfig(mock_data=True))


def biases(chunks) -> dict:
    return {n: b.detach().clone() for c in chunks for n, b in c.named_buffers() if n.endswith("expert_bias")}


def serial_run():
    config = make_config()
    model = GPTModel(config.model)
    model.init_weights(7)
    opt = build_optimizer(model, config.train)
    results = [train_step(model, opt, global_batch(config.model, s), config.train, s, LossScaler(False))
               for s in range(STEPS)]
    return [r.loss for r in results], [r.grad_norm for r in results], biases([model])


def _train(rank, world, layout, stage):
    config = make_config(**layout)
    grid = build_grid(config.parallel, world, rank, experts=True)
    chunks = build_model_chunks(config, grid)
    for c in chunks:
        c.init_weights(7)
    opt = DistributedOptimizer(chunks, config.train, grid, stage=stage, bucket_size=2000)
    dp, r = grid.layout.dp, grid.dp_rank
    losses, norms = [], []
    for s in range(STEPS):
        micro = global_batch(config.model, s)
        result = train_step(chunks, opt, [micro[i] for i in range(len(micro)) if i % dp == r], config.train, s,
                            LossScaler(False), grid)
        losses.append(result.loss)
        norms.append(result.grad_norm)
    return config, grid, chunks, opt, (losses, norms, biases(chunks))


def _worker(rank, world, root):
    out = {}
    for name, (layout, stage) in LAYOUTS.items():
        out[name] = _train(rank, world, layout, stage)[4]
    # checkpoints: saved at EP2 after 6 steps, loaded at TP2 x EP2 into fresh (zero-bias) models
    config, grid, chunks, opt, _ = _train(rank, world, dict(ep=2), 0)
    save_checkpoint(f"{root}/megalite", STEPS, opt, None, config, grid, 0)
    save_dcp_checkpoint(f"{root}/dcp", STEPS, opt, None, config, grid, 0)
    for fmt, load in (("megalite", load_checkpoint), ("dcp", load_dcp_checkpoint)):
        config = make_config(tp=2, ep=2)
        grid = build_grid(config.parallel, world, rank, experts=True)
        chunks = build_model_chunks(config, grid)
        for c in chunks:
            c.init_weights(7)
        opt = DistributedOptimizer(chunks, config.train, grid, stage=1, bucket_size=2000)
        load(f"{root}/{fmt}", opt, None, config, grid)
        out[f"loaded from {fmt}"] = biases(chunks)
    return out


@pytest.mark.slow  # a 4-rank world: the full suite runs it, the fast tier leaves it out
def test_deepseek_routing_layouts_equal_serial_and_biases_bit_identical(tmp_path):
    losses, norms, serial_biases = serial_run()
    assert any(b.abs().sum() > 0 for b in serial_biases.values())
    for rank_out in run_world(_worker, 4, str(tmp_path), timeout=300):
        for name in LAYOUTS:
            got_losses, got_norms, got_biases = rank_out[name]
            for a, b in zip(got_losses, losses):
                assert abs(a - b) / b < TOL, (name, got_losses, losses)
            for a, b in zip(got_norms, norms):
                assert abs(a - b) / b < TOL, (name, got_norms, norms)
            for layer, bias in got_biases.items():  # PP: each stage holds its own layers' biases
                assert torch.equal(bias, serial_biases[layer]), (name, layer, bias, serial_biases[layer])
            assert got_biases or name.startswith("PP")
        for fmt in ("megalite", "dcp"):
            loaded = rank_out[f"loaded from {fmt}"]
            assert loaded.keys() == serial_biases.keys()
            for layer, bias in loaded.items():
                assert torch.equal(bias, serial_biases[layer]), (fmt, layer)
    reshard_checkpoint.reshard(str(tmp_path / "megalite"), str(tmp_path / "pp2"), pp=2, ep=1)  # the offline tool
    reshard_checkpoint.reshard(str(tmp_path / "megalite"), str(tmp_path / "to_dcp"), to_format="torch_dcp")
    for fmt, load in (("megalite", load_serial_model), ("dcp", load_dcp_serial_model), ("pp2", load_serial_model),
                      ("to_dcp", load_dcp_serial_model)):  # one process, bf16
        loaded = biases([load(str(tmp_path / fmt), torch.bfloat16)])
        assert loaded.keys() == serial_biases.keys()
        for layer, bias in loaded.items():
            assert bias.dtype == torch.float32 and torch.equal(bias, serial_biases[layer]), (fmt, layer)
