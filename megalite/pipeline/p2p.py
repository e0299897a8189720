"""Point-to-point exchange between neighbouring pipeline stages.

One function, :func:`communicate`, posts up to four operations in one
``batch_isend_irecv`` and waits for all of them:

    send_next  -> activation to the next stage        (tag ACTIVATION)
    recv_prev  <- activation from the previous stage  (tag ACTIVATION)
    send_prev  -> gradient to the previous stage      (tag GRADIENT)
    recv_next  <- gradient from the next stage        (tag GRADIENT)

Because a rank's sends and receives of one tick are posted together, two neighbours that
exchange in both directions in the same tick cannot wait on each other (the deadlock of
blocking send-then-receive). Shapes are known from the config (s/TP under sequence
parallelism, micro batch, hidden), so no shape handshake is needed. Tags keep the two
directions apart when the next and previous stage are the same rank (P = 2 with
interleaving, whose ring wraps around). Neighbours wrap around the ring: the last stage's
"next" is the first stage, as the interleaved schedule needs.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from megalite.observe.memory_tracker import category
from megalite.parallel import comm

ACTIVATION, GRADIENT = 0, 1


class PipeComm:
    """A rank's link to its pipeline neighbours for one tensor shape and dtype."""

    def __init__(self, grid, shape: tuple[int, ...], dtype=torch.float32, device="cpu"):
        self.next_rank = grid.neighbours["pp_next"]
        self.prev_rank = grid.neighbours["pp_prev"]
        self.group = grid.pp_group  # NCCL batches p2p per communicator: the pp one, not the world
        self.shape, self.dtype, self.device = tuple(shape), dtype, torch.device(device)

    def _empty(self) -> torch.Tensor:
        with category("communication"):
            return torch.empty(self.shape, dtype=self.dtype, device=self.device)

    def communicate(self, send_next=None, send_prev=None, recv_prev=False, recv_next=False):
        """Post the given sends/receives together; return (from_prev, from_next)."""
        ops, from_prev, from_next = [], None, None
        if send_next is not None:
            ops.append(dist.P2POp(dist.isend, self._checked(send_next), self.next_rank, self.group, ACTIVATION))
            comm._record("send", send_next, group=self.group)
        if recv_prev:
            from_prev = self._empty()
            ops.append(dist.P2POp(dist.irecv, from_prev, self.prev_rank, self.group, ACTIVATION))
        if send_prev is not None:
            ops.append(dist.P2POp(dist.isend, self._checked(send_prev), self.prev_rank, self.group, GRADIENT))
            comm._record("send", send_prev, group=self.group)
        if recv_next:
            from_next = self._empty()
            ops.append(dist.P2POp(dist.irecv, from_next, self.next_rank, self.group, GRADIENT))
        if ops:
            works = dist.batch_isend_irecv(ops)
            with comm.blocked():  # waiting for the neighbour stage (straggler reports)
                for work in works:
                    work.wait()
        if from_prev is not None:
            from_prev.requires_grad_(True)  # a leaf: its .grad is what we send back
        return from_prev, from_next

    def _checked(self, tensor: torch.Tensor) -> torch.Tensor:
        if tuple(tensor.shape) != self.shape or tensor.dtype != self.dtype or tensor.device != self.device:
            raise RuntimeError(f"pipeline p2p: sending {tuple(tensor.shape)} {tensor.dtype} on {tensor.device} "
                               f"but the receiver expects {self.shape} {self.dtype} on {self.device} "
                               f"(from the config and the model)")
        return tensor.detach().contiguous()

    # Readable names for the one-directional cases.
    def recv_forward(self):
        return self.communicate(recv_prev=True)[0]

    def send_forward(self, output):
        self.communicate(send_next=output)

    def recv_backward(self):
        return self.communicate(recv_next=True)[1]

    def send_backward(self, grad):
        self.communicate(send_prev=grad)
