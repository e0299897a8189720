"""Random numbers: which ranks share a stream and which must differ.

Two concerns, kept apart:

1. **Initialization is layout-independent.** Every parameter is drawn in full from a
   generator seeded by ``(seed, parameter name)`` and then sliced to the shard a rank
   owns (:func:`init_full_tensor`). The same ``--seed`` therefore gives the same full
   model whatever TP/PP/DP later split it into, and no rank ever needs another's
   random state.

2. **Dropout streams** (:class:`RNGTracker`). A dropout mask must
   - differ across data-parallel (and context-parallel) ranks, which see different
     tokens; repeating one mask on every replica quietly shrinks the effective batch;
   - differ across pipeline stages, which hold different layers;
   - agree across tensor-parallel ranks where the tensor is *replicated* over TP
     (hidden dropout on the full hidden state): the ``"default"`` stream;
   - differ across tensor-parallel ranks where the tensor is *split* over TP
     (attention-probability dropout on a rank's heads): the ``"tensor-parallel"``
     stream, entered with ``with tracker.fork("tensor-parallel"):``.

Seeds (``s`` = --seed)::

    default:          s + 100 * pp + 1_000_003 * (dp * CP + cp)        same on all TP ranks
    tensor-parallel:  default + 2718 + 7919 * tp                         differs over TP

The global torch generator runs the ``"default"`` stream (so ``F.dropout`` uses it);
``fork`` swaps in another stream's state and swaps it back out afterwards.
"""
from __future__ import annotations

import contextlib
import hashlib

import torch

TENSOR_PARALLEL = "tensor-parallel"


def name_seed(seed: int, name: str) -> int:
    """A 63-bit seed derived from the run seed and a parameter's global name."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def init_full_tensor(shape, seed: int, name: str, std: float, dtype=torch.float32) -> torch.Tensor:
    """N(0, std^2) tensor of the *full* (unsharded) shape, reproducible from (seed, name)."""
    generator = torch.Generator(device="cpu").manual_seed(name_seed(seed, name))
    return torch.randn(tuple(shape), generator=generator, dtype=torch.float32).mul_(std).to(dtype)


def dropout_seeds(seed: int, tp_rank: int = 0, cp_rank: int = 0, dp_rank: int = 0,
                  pp_rank: int = 0, cp_size: int = 1) -> dict[str, int]:
    default = seed + 100 * pp_rank + 1_000_003 * (dp_rank * cp_size + cp_rank)
    return {"default": default, TENSOR_PARALLEL: default + 2718 + 7919 * tp_rank}


class RNGTracker:
    """Named random streams: each holds a CPU generator state and, when the model runs on a
    GPU, that GPU's generator state (dropout on CUDA tensors draws from the CUDA generator).

    ``seed(seeds, device)`` seeds every stream on the CPU and on ``device`` when it is a CUDA
    device; checkpoints save and restore both, so a GPU resume is bit-exact like a CPU one.
    """

    def __init__(self):
        self._states: dict[str, tuple[torch.Tensor, torch.Tensor | None]] = {}
        self.cuda_device: torch.device | None = None

    def _get_state(self):
        cuda = torch.cuda.get_rng_state(self.cuda_device) if self.cuda_device is not None else None
        return torch.get_rng_state(), cuda

    def _set_state(self, state):
        cpu, cuda = state
        torch.set_rng_state(cpu)
        if cuda is not None and self.cuda_device is not None:
            torch.cuda.set_rng_state(cuda, self.cuda_device)

    def seed(self, seeds: dict[str, int], device=None) -> None:
        """Seed every stream; the global generators are left on the "default" stream."""
        device = torch.device(device) if device is not None else None
        self.cuda_device = device if device is not None and device.type == "cuda" else None
        self._states.clear()
        for name, value in seeds.items():
            if name == "default":
                continue
            saved = self._get_state()
            torch.manual_seed(value)  # the CPU generator and every CUDA one
            self._states[name] = self._get_state()
            self._set_state(saved)
        torch.manual_seed(seeds["default"])

    @contextlib.contextmanager
    def fork(self, name: str = TENSOR_PARALLEL):
        """Run the block on stream ``name``; its advanced state is kept for next time."""
        if name not in self._states:
            raise KeyError(f"RNG stream {name!r} was never seeded; call model_parallel_seed() first")
        saved = self._get_state()
        self._set_state(self._states[name])
        try:
            yield
        finally:
            self._states[name] = self._get_state()
            self._set_state(saved)

    def stream_states(self) -> dict:
        """Copies of the non-default streams (for activation recomputation)."""
        return {name: (cpu.clone(), None if cuda is None else cuda.clone())
                for name, (cpu, cuda) in self._states.items()}

    def set_stream_states(self, states: dict) -> None:
        self._states = {name: (cpu.clone(), None if cuda is None else cuda.clone())
                        for name, (cpu, cuda) in states.items()}

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Byte tensors of every stream, ``<name>.cpu`` and ``<name>.cuda`` (for checkpoints:
        no pickling needed)."""
        cpu, cuda = self._get_state()
        out = {"default.cpu": cpu}
        if cuda is not None:
            out["default.cuda"] = cuda
        for name, (cpu, cuda) in self._states.items():
            out[f"{name}.cpu"] = cpu.clone()
            if cuda is not None:
                out[f"{name}.cuda"] = cuda.clone()
        return out

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Restore what ``state_dict`` saved; CUDA states only when this run is on a GPU
        (a CPU checkpoint resumed on a GPU keeps the GPU streams as seeded)."""
        streams: dict[str, dict[str, torch.Tensor]] = {}
        for key, value in state.items():
            name, kind = key.rsplit(".", 1)
            streams.setdefault(name, {})[kind] = value.clone()
        for name, kinds in streams.items():
            current = self._get_state() if name == "default" else self._states.get(name, (None, None))
            cuda = kinds.get("cuda") if self.cuda_device is not None else None
            restored = (kinds.get("cpu", current[0]), cuda if cuda is not None else current[1])
            if name == "default":
                self._set_state(restored)
            else:
                self._states[name] = restored


_TRACKER = RNGTracker()


def get_rng_tracker() -> RNGTracker:
    return _TRACKER


def model_parallel_seed(seed: int, grid=None, device=None) -> RNGTracker:
    """Seed the dropout streams for this rank's place in the grid (see module docstring), on
    the CPU and on ``device`` when it is a GPU."""
    if grid is None:
        seeds = dropout_seeds(seed)
    else:
        c = grid.coord
        seeds = dropout_seeds(seed, c.tp, c.cp, c.dp, c.pp, grid.layout.cp)
    _TRACKER.seed(seeds, device)
    return _TRACKER
