"""The host-sync counter (megalite.observe.host_syncs) sees every kind of read, and only megalite's.

Each case is a one-line function that makes one kind of read a GPU would synchronize on. The
function is compiled under a file name inside ``megalite/`` or ``kernels/`` (the counter
decides whose read it is from the calling frame's file, so no file needs to exist), and the
counter must record exactly that read, by name, at that line. The same function compiled
under this test's own file name must record nothing: a test's reads are not megalite's.
The step tests (test_host_syncs.py, test_moe_gpu_faults.py) then rely on this counter to say
that a train step reads nothing.
"""
import os

import pytest
import torch
import torch.nn.functional as F

import megalite
import megalite.kernels
from megalite.observe.host_syncs import PATCHED_READS, count_host_syncs

# name the counter records: the read (s a float scalar tensor, v a float vector, both on the CPU)
READS = {
    "item": "s.item()",
    "__bool__": "1 if s else 0",
    "__int__": "int(s)",
    "__float__": "float(s)",
    "__index__": "[0, 1, 2][s.long()]",
    "__format__": "f'{s:.3f}'",  # torch's Tensor.__format__ calls item from torch's own code
    "tolist": "v.tolist()",
    "numpy": "v.numpy()",
    "cpu": "v.cpu()",
    "_local_scalar_dense": "torch.is_nonzero(s)",  # a scalar read from torch's C++ code
    "equal": "torch.equal(v, v)",
    "allclose": "torch.allclose(v, v)",
    "nonzero": "v.nonzero()",
    "masked_select": "torch.masked_select(v, v > 0)",
    "index (bool mask)": "v[v > 0]",
    "index_put (bool mask)": "v.clone()[v > 0] = 0.0",
    "unique": "torch.unique(v)",
    "unique_consecutive": "torch.unique_consecutive(v)",
    "repeat_interleave": "v.repeat_interleave(torch.tensor([1, 2, 1, 1]))",  # the output size is read
    "bincount": "torch.bincount(torch.tensor([1, 2]))",
}
MORE_READS = {  # other spellings of the same reads
    "torch.nonzero": ("torch.nonzero(v)", "nonzero"),
    "torch.where (one argument)": ("torch.where(v > 0)", "nonzero"),
    "x in t (item inside torch)": ("1.0 in v", "item"),
    "format() without a spec": ("format(s)", "__format__"),
    "bool of a reduction": ("bool((v > 0).any())", "__bool__"),
    "one_hot without num_classes": ("F.one_hot(torch.tensor([0, 2]))", "one_hot (reads the maximum)"),
}
NOT_READS = {  # look alike, but wait for nothing on a GPU
    "to its own device": "v.to(v.device)",
    "repeat_interleave with output_size": "v.repeat_interleave(torch.tensor([1, 2, 1, 1]), output_size=5)",
    "repeat_interleave by an int": "v.repeat_interleave(2)",
    "one_hot with num_classes (checked on the CPU only)": "F.one_hot(torch.tensor([0, 2]), 3)",
    "a mask applied with where": "torch.where(v > 0, v, 0.0)",
    "masked_fill": "v.masked_fill(v > 0, 0.0)",
    "a reduction kept on the device": "(v > 0).any()",
}
ROOTS = {"megalite/": megalite.__path__[0], "kernels/": megalite.kernels.__path__[0]}


def _function(source: str, folder: str):
    """``read(s, v)`` running ``source`` on line 2 of a module file in ``folder``."""
    code = compile(f"def read(s, v):\n    {source}\n", os.path.join(folder, "_probe_reads.py"), "exec")
    namespace = {"torch": torch, "F": F}
    exec(code, namespace)
    return namespace["read"]


def _reads(source: str, folder: str) -> list:
    read = _function(source, folder)
    with count_host_syncs() as calls:
        read(torch.tensor(1.5), torch.tensor([1.0, -2.0, 0.0, 3.0]))
    return list(calls)


@pytest.mark.parametrize("where", list(ROOTS))
@pytest.mark.parametrize("name", list(READS))
def test_every_kind_of_read_is_counted_where_megalite_makes_it(name, where):
    calls = _reads(READS[name], ROOTS[where])
    assert calls == [name], calls
    assert (os.path.basename(calls[0].file), calls[0].line) == ("_probe_reads.py", 2)


@pytest.mark.parametrize("spelling", list(MORE_READS))
def test_other_spellings_of_a_read_are_counted(spelling):
    source, name = MORE_READS[spelling]
    assert _reads(source, ROOTS["megalite/"]) == [name]


@pytest.mark.parametrize("name", list(READS) + list(MORE_READS))
def test_a_tests_own_read_is_not_counted(name):
    source = READS[name] if name in READS else MORE_READS[name][0]
    assert _reads(source, os.path.dirname(os.path.abspath(__file__))) == []


@pytest.mark.parametrize("case", list(NOT_READS))
def test_what_waits_for_nothing_is_not_counted(case):
    assert _reads(NOT_READS[case], ROOTS["megalite/"]) == []


@pytest.mark.parametrize("source,name", [
    ("torch.empty(2, device='meta').to('cpu')", "to(cpu)"),
    ("torch.empty(2).copy_(torch.empty(2, device='meta'))", "copy to cpu"),
    ("torch.empty(2, device='meta').cpu()", "cpu"),
])
def test_a_copy_from_another_device_to_the_host_is_counted(source, name):
    """The CPU has one device; a meta tensor stands for the GPU. The copy itself fails (a meta
    tensor has no data), after the counter saw it."""
    read = _function(source, ROOTS["megalite/"])
    with count_host_syncs() as calls:
        with pytest.raises(NotImplementedError):
            read(None, None)
    assert calls == [name]


def test_a_non_blocking_copy_to_the_host_is_not_counted():
    read = _function("torch.empty(2, device='meta').to('cpu', non_blocking=True)", ROOTS["kernels/"])
    with count_host_syncs() as calls:
        with pytest.raises(NotImplementedError):
            read(None, None)
    assert calls == []


def test_the_counter_leaves_torch_as_it_found_it():
    """On exit (an exception included) the patches are undone and the dispatch mode is gone:
    a read made afterwards is not recorded, and the reads of the block keep their count."""
    before = {name: getattr(torch.Tensor, name) for name in PATCHED_READS + ("to",)}
    read = _function("torch.equal(v, v); v.tolist()", ROOTS["megalite/"])
    args = (torch.tensor(1.0), torch.arange(3.0))
    with pytest.raises(ValueError):
        with count_host_syncs() as calls:
            read(*args)
            raise ValueError
    read(*args)
    assert calls == ["equal", "tolist"]
    assert {name: getattr(torch.Tensor, name) for name in before} == before
    assert F.one_hot is torch.nn.functional.one_hot and not torch._C._is_torch_function_mode_enabled()
    from torch.utils._python_dispatch import _get_current_dispatch_mode
    assert _get_current_dispatch_mode() is None


def test_autograd_through_the_counter_equals_autograd_without_it():
    """The dispatch mode sits below autograd: the same gradients, and the backward's
    boolean-mask index_put (the gradient of ``v[mask]``) counted where megalite called backward."""
    read = _function("w = v.clone().requires_grad_(); (w[w > 0] ** 2).sum().backward(); return w.grad",
                     ROOTS["megalite/"])
    want = read(None, torch.tensor([1.0, -2.0, 3.0]))
    with count_host_syncs() as calls:
        got = read(None, torch.tensor([1.0, -2.0, 3.0]))
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert calls == ["index (bool mask)", "index_put (bool mask)"], calls
