"""The autotuner's side of every tuned kernel, exercised on the CPU.

With one config (the interpreter's) ``triton.autotune`` neither prunes, keys nor times, so
none of that runs in the other kernel tests; on a GPU all of it runs on the first launch.
Here, in the interpreter:
(a) every prune hook (attention forward, delta, dk/dv, dq; grouped GEMM y/dx and dw) is called
    as Triton calls it, ``early_config_prune(configs_list, nargs_dict, **kwargs)`` with the very
    arguments the launchers pass, on a stand-in CUDA tensor: a list of Configs comes back, the
    ones over the device's shared memory dropped;
(b) real autotuning over the GPU config lists (two or more configs) through
    ``kernels._utils.autotune``: prune, key, timing (``interpreter_bench``; Triton's default
    timing needs a GPU driver), pick, per-key cache, and the result equals the reference;
(c) the ``cache_results`` disk cache (written by one process, read by the next: Triton
    rebuilds the configs from JSON) on the real autotuner, against a stand-in sm_90 target;
(d) ``MEGALITE_KERNEL_TUNING=fixed``: each tuned kernel holds exactly one config, the first of
    its list that fits the device.
"""
from __future__ import annotations

import importlib.util
import types

import pytest
import torch
import triton
from triton.runtime import autotuner

from megalite.kernels import _utils
from megalite.kernels import flash_attention as fa
from megalite.kernels import flash_attention_bwd as fb
from megalite.kernels import grouped_gemm as gg
from megalite.kernels.attention_reference import attention_reference

SM80, SM86, SM90 = 163 * 1024, 99 * 1024, 227 * 1024
HEAD_DIM = 24  # tile width 32; configs of the d <= 64 lists


def gpu_lists(d=HEAD_DIM, dtype=torch.float16):
    """{kernel name: (its GPU config list, its estimate config -> bytes at (d, dtype))}."""
    width, size = _utils.block_d(d), dtype.itemsize
    return {
        "_fwd_kernel": (fa.fwd_configs(d, dtype, interpret=False), lambda c: fa.fwd_shared_bytes(c, width, size)),
        "_dkdv_kernel": (fb.dkdv_configs(d, dtype, interpret=False), lambda c: fb.dkdv_shared_bytes(c, width, size)),
        "_dq_kernel": (fb.dq_configs(d, dtype, interpret=False), lambda c: fb.dq_shared_bytes(c, width, size)),
        "_delta_kernel": (fb.delta_configs(d, dtype, interpret=False),
                          lambda c: fb.delta_shared_bytes(c, width, size)),
        "_gmm_kernel": (_gemm_list("mm", dtype), lambda c: gg.shared_bytes(c, size)),
        "_gmm_dw_kernel": (_gemm_list("dw", dtype), lambda c: gg.shared_bytes(c, size)),
    }


MM_CONFIGS, DW_CONFIGS = gg.mm_configs, gg.dw_configs


def _gemm_list(kind, dtype):
    """The grouped GEMM's GPU list (its config functions read the module's INTERPRET)."""
    import unittest.mock

    with unittest.mock.patch.object(gg, "INTERPRET", False):
        return MM_CONFIGS(dtype) if kind == "mm" else DW_CONFIGS(dtype)


def base_name(tuner) -> str:
    return tuner.base_fn.__name__


def clear_builds():
    for build in (fa._build_fwd, fb._build, gg._build):
        build.cache_clear()


@pytest.fixture
def gpu_configs(monkeypatch):
    """The launchers build their autotuners over the GPU config lists (fresh ones, dropped after)."""
    for module, name in ((fa, "fwd_configs"), (fb, "dkdv_configs"), (fb, "dq_configs"), (fb, "delta_configs")):
        original = getattr(module, name)
        monkeypatch.setattr(module, name, lambda d, dtype=torch.float32, interpret=None, f=original: f(d, dtype, False))
    monkeypatch.setattr(gg, "mm_configs", lambda dtype: _gemm_list("mm", dtype))
    monkeypatch.setattr(gg, "dw_configs", lambda dtype: _gemm_list("dw", dtype))
    clear_builds()
    yield
    clear_builds()


class Runs:
    """Records every Autotuner.run: (autotuner, positional args, keyword args), then runs it."""

    def __init__(self, monkeypatch):
        self.calls = []
        original = autotuner.Autotuner.run

        def run(tuner, *args, **kwargs):
            self.calls.append((tuner, args, dict(kwargs)))
            return original(tuner, *args, **kwargs)

        monkeypatch.setattr(autotuner.Autotuner, "run", run)

    def tuners(self) -> dict:
        return {base_name(t): t for t, _, _ in self.calls}


def randn(*shape, seed=0, dtype=torch.float16):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def attention_case(s_q=40, s_k=40, seed=0):
    q, dout = randn(1, 2, s_q, HEAD_DIM, seed=seed), randn(1, 2, s_q, HEAD_DIM, seed=seed + 1)
    k, v = randn(1, 1, s_k, HEAD_DIM, seed=seed + 2), randn(1, 1, s_k, HEAD_DIM, seed=seed + 3)
    return q, k, v, dout


def err(a, ref) -> float:
    return (a.double() - ref.double()).abs().max().item() / max(0.1, ref.abs().max().item())


def run_all(q, k, v, dout):
    """Every tuned kernel once: attention forward and backward (returned), and a grouped linear
    with its gradients (checked against the torch loop here)."""
    out, lse = fa.flash_attention_forward(q, k, v, causal=True)
    grads = fb.flash_attention_backward(q, k, v, out, dout, lse, causal=True)
    x, w = randn(9, 40, seed=7).requires_grad_(), randn(3, 24, 40, seed=8).requires_grad_()
    y = gg.grouped_linear(x, w, [4, 0, 5])
    y.backward(torch.ones_like(y))
    xr, wr = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    yr = gg.grouped_linear_reference(xr, wr, [4, 0, 5])
    yr.backward(torch.ones_like(yr))
    assert err(y, yr) < 2e-3 and err(x.grad, xr.grad) < 2e-3 and err(w.grad, wr.grad) < 2e-3
    return out, lse, grads


def check_attention(q, k, v, dout, out, lse, grads, tol=2e-3):
    """fp16 results against the float64 reference (relative to the largest value, at least 1)."""
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    ref_out, ref_lse = attention_reference(*leaves, causal=True)
    ref_out.backward(dout.double())
    assert err(out, ref_out) < tol and err(lse, ref_lse) < tol
    for g, leaf in zip(grads, leaves):
        assert err(g, leaf.grad) < tol


# -- (a) every prune hook, called as Triton calls it -------------------------------------------------

class FakeCuda:
    """What a prune hook may read of a CUDA tensor argument, for a CPU tensor's dtype."""
    is_cuda = True
    device = torch.device("cuda", 0)

    def __init__(self, t: torch.Tensor):
        self.dtype, self.shape = t.dtype, t.shape

    def element_size(self):
        return self.dtype.itemsize


@pytest.mark.parametrize("limit", [SM86, SM80, SM90], ids=["sm86", "sm80", "sm90"])
def test_every_prune_hook_as_triton_calls_it(monkeypatch, limit):
    runs = Runs(monkeypatch)
    run_all(*attention_case())
    tuners = runs.tuners()
    assert sorted(tuners) == sorted(gpu_lists())
    monkeypatch.setattr(_utils, "shared_memory_limit", lambda index: limit)
    dropped = 0
    for tuner, args, kwargs in runs.calls:
        configs, nbytes = gpu_lists()[base_name(tuner)]
        assert "grid" in kwargs and "warmup" in kwargs  # what Triton's launch adds to the kwargs
        nargs = {name: FakeCuda(a) if isinstance(a, torch.Tensor) else a for name, a in zip(tuner.arg_names, args)}
        kept = tuner.early_config_prune(list(configs), nargs, **kwargs)
        assert isinstance(kept, list) and kept and all(isinstance(c, triton.Config) for c in kept)
        fitting = [c for c in configs if nbytes(c) <= limit]
        assert kept == (fitting or [min(configs, key=nbytes)]), base_name(tuner)
        dropped += len(configs) - len(kept)
        # a CPU tensor (the interpreter): nothing is dropped
        cpu = dict(zip(tuner.arg_names, args))
        assert tuner.early_config_prune(list(configs), cpu, **kwargs) == list(configs)
    assert dropped > 0 or limit != SM86  # at width 32 only a ~100 KB GPU drops configs


def test_autotune_keys_are_arguments_the_launchers_pass(monkeypatch):
    """Triton 3.6 silently drops a key name that is no kernel argument (3.9 refuses it): every
    key must be an argument and every launch must pass it."""
    runs = Runs(monkeypatch)
    run_all(*attention_case())
    for tuner, args, kwargs in runs.calls:
        passed = {**dict(zip(tuner.arg_names, args)), **kwargs}
        assert tuner.keys and all(k in tuner.arg_names and k in passed for k in tuner.keys), base_name(tuner)


# -- (b) autotuning over several configs in the interpreter -----------------------------------------

def test_autotuning_several_configs_end_to_end_in_the_interpreter(monkeypatch, gpu_configs):
    """Each tuned kernel over its GPU list, pruned at a ~100 KB device: the pruned configs are
    all timed, the fastest is cached per key, and the results equal the reference."""
    monkeypatch.setattr(_utils, "device_shared_limit", lambda t: SM86)
    runs = Runs(monkeypatch)
    q, k, v, dout = attention_case()
    out, lse, grads = run_all(q, k, v, dout)
    check_attention(q, k, v, dout, out, lse, grads)
    tuners = runs.tuners()
    assert sorted(tuners) == sorted(gpu_lists())
    for name, tuner in tuners.items():
        configs, nbytes = gpu_lists()[name]
        assert len(tuner.configs) == len(configs) >= 2, name
        pruned = [c for c in configs if nbytes(c) <= SM86]
        assert tuner.cache and all(picked in pruned for picked in tuner.cache.values()), name
        if len(pruned) > 1:  # every fitting config was timed (for the last key tuned)
            assert set(tuner.configs_timings) == set(pruned), name
    # the same key again: no new tuning; a longer sequence: a new key
    fwd = tuners["_fwd_kernel"]
    fa.flash_attention_forward(q, k, v, causal=True)
    assert len(fwd.cache) == 1
    q2, k2, v2, _ = attention_case(s_q=70, s_k=70)
    fa.flash_attention_forward(q2, k2, v2, causal=True)
    keys = sorted(fwd.cache)
    assert len(keys) == 2 and keys[0][:5] == (HEAD_DIM, True, False, 64, 64) \
        and keys[1][:5] == (HEAD_DIM, True, False, 128, 128)  # (head dim, causal, documents, s_q, s_k)
    assert "torch.float16" in keys[0]


# -- (c) the disk cache of the autotuner's choice ----------------------------------------------------

def test_the_disk_cache_of_choices_round_trips(monkeypatch, tmp_path, gpu_configs):
    """cache_results: the first autotuner times and writes its timings; a fresh one (a restarted
    process) rebuilds the configs from the JSON and picks the same without timing. Triton turns
    the cache off under the interpreter and hashes the GPU target: both are stood in for here."""
    from triton.backends.compiler import GPUTarget

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    target = types.SimpleNamespace(get_current_target=lambda: GPUTarget("cuda", 90, 32))
    monkeypatch.setattr(autotuner, "driver", types.SimpleNamespace(active=target))
    # the cache is keyed by the compiled function's source hash: the interpreted one stands in
    from triton.runtime.interpreter import InterpretedFunction

    monkeypatch.setattr(autotuner, "JITFunction", InterpretedFunction)
    monkeypatch.setattr(InterpretedFunction, "cache_key", "source-hash", raising=False)
    q, k, v, _ = attention_case()
    picks = []
    for attempt in range(2):
        clear_builds()
        tuner = fa._tuned_fwd(HEAD_DIM, torch.float16)
        tuner.cache_results = True
        timed = []
        # Each config "timed" (the interpreter's real timings take seconds and say nothing here):
        # Triton's _bench returns the (median, p20, p80) of its runs; a later config is slower.
        monkeypatch.setattr(tuner, "_bench", lambda *a, config, **kw: timed.append(config) or [float(len(timed))] * 3)
        fa.flash_attention_forward(q, k, v, causal=True)
        (pick,) = tuner.cache.values()
        picks.append((pick, len(timed)))
    assert picks[0][1] == len(fa.fwd_configs(HEAD_DIM, torch.float16)) and picks[1][1] == 0
    assert picks[1][0] == picks[0][0] and isinstance(picks[1][0], triton.Config)
    assert list(tmp_path.rglob("*.autotune.json"))


# -- (d) MEGALITE_KERNEL_TUNING=fixed ----------------------------------------------------------------

@pytest.mark.parametrize("limit", [SM86, SM80, SM90], ids=["sm86", "sm80", "sm90"])
def test_fixed_config_is_the_first_that_fits(limit):
    for d in (64, 96, 128, 256):
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            for name, (configs, nbytes) in gpu_lists(d, dtype).items():
                want = next((c for c in configs if nbytes(c) <= limit), min(configs, key=nbytes))
                assert _utils.fixed_config(configs, limit, nbytes) is want, (name, d, dtype)
    configs, nbytes = gpu_lists()["_fwd_kernel"]
    assert _utils.fixed_config(configs, None, nbytes) is configs[0]


def test_fixed_tuning_gives_each_tuned_kernel_one_config(monkeypatch, gpu_configs):
    """With TUNING = fixed on an (emulated) sm_86 GPU, every _tuned* holds exactly the first
    config that fits; on the CPU it launches it (no pruning, no timing) and is right."""
    monkeypatch.setattr(_utils, "TUNING", "fixed")
    monkeypatch.setattr(_utils, "INTERPRET", False)  # fixed_limit asks the (emulated) GPU
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(_utils, "shared_memory_limit", lambda index: SM86)
    for d in (64, 128, 256):
        for dtype in (torch.bfloat16, torch.float32):
            lists = gpu_lists(d, dtype)
            built = {"_fwd_kernel": fa._tuned_fwd(d, dtype), "_dkdv_kernel": fb._tuned("dkdv", d, dtype),
                     "_dq_kernel": fb._tuned("dq", d, dtype), "_delta_kernel": fb._tuned("delta", d, dtype),
                     "_gmm_kernel": gg._tuned("mm", dtype), "_gmm_dw_kernel": gg._tuned("dw", dtype)}
            for name, tuner in built.items():
                configs, nbytes = lists[name]
                want = next(c for c in configs if nbytes(c) <= SM86)
                assert tuner.configs == [want], (name, d, dtype)
    monkeypatch.setattr(_utils, "INTERPRET", True)
    clear_builds()
    runs = Runs(monkeypatch)
    monkeypatch.setattr(_utils, "device_shared_limit", lambda t: pytest.fail("fixed: nothing is pruned"))
    q, k, v, dout = attention_case()
    check_attention(q, k, v, dout, *run_all(q, k, v, dout))
    for tuner, _, _ in runs.calls:
        assert len(tuner.configs) == 1 and not tuner.cache


def test_the_setting_is_read_at_import_and_checked(monkeypatch):
    def load():
        spec = importlib.util.spec_from_file_location("tuning_probe", _utils.__file__)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    monkeypatch.delenv("MEGALITE_KERNEL_TUNING", raising=False)
    assert load().TUNING == "autotune"
    monkeypatch.setenv("MEGALITE_KERNEL_TUNING", "fixed")
    assert load().TUNING == "fixed"
    monkeypatch.setenv("MEGALITE_KERNEL_TUNING", "fast")
    with pytest.raises(ValueError, match="'autotune'.*'fixed'"):
        load()
