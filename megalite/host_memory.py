"""Host memory the GPU copies to and from: one reusable, page-locked allocation, exact size.

Used where host buffers live long and are copied to or from the GPU often: an asynchronous
save's staged state (allocated at the first save, reused while the layout stays the same, laid
out in the file's order so the writer writes it in one run) and the gradient and weight staging
buffers of optimizer offload. Every tensor is a view of one flat byte buffer (one allocation).

On a GPU the buffer is page-locked, so device-to-host copies run asynchronously at full
bandwidth. It is locked by registering ordinary host memory with CUDA (``cudaHostRegister``,
portable: usable from every context), not allocated with ``pin_memory=True``: that goes
through torch's caching host allocator, which rounds each block up to a power of two (a 5 GiB
checkpoint would hold 8 GiB of locked memory, and per-tensor blocks round one by one) and keeps
the blocks cached after they are freed. Registered memory is exactly the checkpoint's size and
is unlocked by :meth:`HostBuffer.free`.
"""
from __future__ import annotations

import math

import torch



def _register(flat: torch.Tensor) -> None:
    code = int(torch.cuda.cudart().cudaHostRegister(flat.data_ptr(), flat.numel(), 1))  # 1: portable
    if code != 0:
        raise RuntimeError(f"could not page-lock {flat.numel() / 2**20:.0f} MiB of host memory (cudaHostRegister "
                           f"error {code}) for an asynchronous save or optimizer offload: the host's locked-memory "
                           f"limit (ulimit -l) may be too low; raise it, or run without --async-save / "
                           f"--offload-optimizer")


class HostBuffer:
    """Views of one host allocation. ``views(layout, pinned)``: ``{key: tensor}`` views of one host buffer for ``layout``
    ([(key, shape, dtype)], in the order the bytes are laid out), reallocated only when the
    layout or ``pinned`` changes. ``free()`` releases it (unregistered from CUDA first)."""

    def __init__(self):
        self.flat: torch.Tensor | None = None
        self.pinned = False
        self._layout: list | None = None
        self._views: dict[str, torch.Tensor] = {}

    def views(self, layout: list, pinned: bool) -> dict:
        if layout != self._layout or pinned != self.pinned:
            self._allocate(layout, pinned)
        return self._views

    def _allocate(self, layout: list, pinned: bool) -> None:
        sizes = [math.prod(shape) * torch.empty((), dtype=dtype).element_size() for _, shape, dtype in layout]
        self.free()
        self.flat = torch.empty(sum(sizes), dtype=torch.uint8)
        if pinned and self.flat.numel():
            _register(self.flat)
            self.pinned = True
        offset = 0
        for (key, shape, dtype), size in zip(layout, sizes):
            self._views[key] = self.flat[offset: offset + size].view(dtype).view(shape)
            offset += size
        self._layout = list(layout)

    def free(self) -> None:
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self.flat.data_ptr())
        self.flat, self.pinned, self._layout, self._views = None, False, None, {}
