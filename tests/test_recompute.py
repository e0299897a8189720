"""Activation recomputation: the same losses and gradients (dropout included), less memory."""
import pytest
import torch

from megalite.config import ModelConfig, ParallelConfig
from megalite.model.gpt import GPTModel
from megalite.parallel.grid import build_grid
from megalite.parallel.random import model_parallel_seed
from megalite.testing import run_world


def cfg(**kw):
    return ModelConfig(num_layers=4, hidden_size=32, num_attention_heads=4, vocab_size=97, seq_length=32,
                       hidden_dropout=0.1, attention_dropout=0.1, **kw)


def run(model_cfg, grid=None, seed=3):
    model_parallel_seed(seed, grid)
    model = GPTModel(model_cfg, tp_group=grid.tp_group if grid else None)
    model.init_weights(1)
    x = torch.randint(0, 97, (4, 33), generator=torch.Generator().manual_seed(0))
    saved = [0, 0]  # live, peak bytes of tensors autograd keeps for backward (no parameters)
    params = {id(p) for p in model.parameters()}

    def pack(t):
        if id(t) not in params:
            saved[0] += t.numel() * t.element_size()
            saved[1] = max(saved[1], saved[0])
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(x[:, :-1], labels=x[:, 1:]).mean()
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}, saved[1]


SETTINGS = [dict(recompute_granularity="full"),
            dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=2),
            dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=2),
            dict(recompute_granularity="selective")]


@pytest.mark.parametrize("setting", SETTINGS, ids=lambda s: "-".join(str(v) for v in s.values()))
def test_recompute_same_loss_and_gradients_less_memory(setting):
    loss, grads, memory = run(cfg())
    loss_r, grads_r, memory_r = run(cfg(**setting))
    assert loss_r == loss
    assert all(torch.equal(grads[n], grads_r[n]) for n in grads)  # bit-identical, dropout included
    if setting["recompute_granularity"] == "full":
        assert memory_r < 0.6 * memory, (memory_r, memory)
    else:
        assert memory_r < memory, (memory_r, memory)
    print(setting, "saved activations:", memory, "->", memory_r, "bytes")


def _tp_worker(rank, world):
    grid = build_grid(ParallelConfig(tensor_model_parallel_size=world), world, rank)
    loss, grads, _ = run(cfg(), grid)
    loss_r, grads_r, _ = run(cfg(recompute_granularity="full"), grid)
    return loss == loss_r and all(torch.equal(grads[n], grads_r[n]) for n in grads)


def test_recompute_with_tensor_parallel_dropout_streams():
    """Attention dropout under TP draws from the tensor-parallel stream: the recompute must
    replay it (and leave the stream where the forward left it)."""
    assert all(run_world(_tp_worker, 2))
