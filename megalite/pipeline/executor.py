"""Run one step of any pipeline schedule: the rank's operation list of a resolved
:class:`~megalite.pipeline.plan.PipelineSchedule`, with asynchronous p2p.

Every schedule runs here: gpipe, 1f1b, interleaved 1F1B, zb-h1, zbv, and evaluation (forward
only, on the training schedule's placement). The zero-bubble schedules interleave F, B and W
in orders that no fixed tick pattern describes, so the executor takes the rank's list as it is
and handles the exchange with the neighbours apart from it:

- **Order of the exchange.** Every p2p message of the step has a place in one global order
  (:meth:`megalite.pipeline.plan.Simulation.messages`: when the unit-time simulation produces it). Each rank posts
  its sends and receives in that order: a receive as soon as every earlier message of the
  rank is posted, a send as soon as its data exists. Two ends of a link therefore post its
  messages in the same order (what NCCL, which ignores tags, needs), and no rank ever waits
  on a message that sits behind one it has not produced: the message a rank needs for its
  next operation was produced in the simulation no later than that operation starts, so
  every message before it was produced by an operation this rank has already run. The
  same argument holds for a rank's links taken together, so one shared stream per rank
  (NCCL's p2p on one communicator) cannot deadlock either.
- **Overlap.** Sends and receives are ``isend`` / ``irecv``: a send returns at once (its
  output's storage is released, the send keeps the data alive until it completes), and a
  receive is waited for only right before the operation that needs it.
- **Local hand-offs.** In ZBV rank P-1 holds global chunks P-1 and P, so the turn of the V
  (activation forward, gradient back) passes through memory, not the network.
- **B and W.** B back-propagates inside ``WeightGradStore.collecting((micro, chunk))``: the
  layers' weight gradients wait in the store (:mod:`megalite.layers.weight_grad`) until W
  runs them. ``BW`` (the classical backward) runs both at once, so the classical schedules
  run here unchanged too (the tests use that).
"""
from __future__ import annotations

import contextlib
from collections import deque

import torch
import torch.distributed as dist
from torch.autograd.variable import Variable

from megalite.device import is_fake
from megalite.layers.weight_grad import WeightGradStore, split_weight_gradients
from megalite.parallel import comm
from megalite.pipeline.p2p import PipeComm
from megalite.pipeline.plan import PipelineSchedule

TAG = 0  # one tag for both directions: the order alone matches messages, as on NCCL


def _release(output: torch.Tensor) -> None:
    """Free an activation's storage once sent; its grad_fn stays for backward."""
    output.data = torch.empty((1,), dtype=output.dtype, device=output.device)


def _backward(output: torch.Tensor, grad: torch.Tensor | None) -> None:
    """Back-propagate from a stage output. The output's storage may have been released
    (see _release), so call the autograd engine directly: torch.autograd.backward would
    compare the gradient's shape with the (now empty) output's."""
    if grad is None:
        output.backward()  # the scaled loss on the last stage
        return
    Variable._execution_engine.run_backward(
        tensors=(output,), grad_tensors=(grad,), keep_graph=False, create_graph=False,
        inputs=(), allow_unreachable=True, accumulate_grad=True)


class ScheduleExecutor:
    """One step of the resolved ``schedule`` over this rank's chunks (local chunk order as in
    :meth:`PipelineSchedule.global_chunk`). ``forward_fn(chunk_module, input_tensor, batch)``
    returns the activation to send or, on the loss chunk, the per-token losses; the executor
    collects the unscaled micro-batch losses in ``losses`` and back-propagates the loss times
    ``loss_scale / M``. ``run()``; ``losses``; ``trace`` (a :class:`~megalite.pipeline.trace.Trace`)."""

    def __init__(self, schedule: PipelineSchedule, chunks, micro_batches, grid, shape, forward_fn, loss_fn,
                 trace=None, dtype=torch.float32, loss_scale: float = 1.0, device="cpu"):
        self.schedule, self.chunks, self.batches = schedule, chunks, micro_batches
        self.P, self.M, self.rank = grid.layout.pp, len(micro_batches), grid.pp_rank
        self.V = schedule.V
        if len(chunks) != self.V or schedule.P != self.P:
            raise ValueError(f"schedule {schedule.name} runs {schedule.V} chunks per rank on {schedule.P} "
                             f"ranks, got {len(chunks)} chunks on {self.P}")
        self.S = schedule.chunks
        self.forward_fn, self.loss_fn, self.loss_scale, self.trace = forward_fn, loss_fn, loss_scale, trace
        self.comm = PipeComm(grid, shape, dtype, device)
        self.ops = schedule.ops(self.M, self.rank)
        self.queue = deque(schedule.messages(self.M, self.rank))
        self.store = WeightGradStore()
        self.losses: list[torch.Tensor] = []
        self.max_in_flight = 0  # chunk activations whose B is pending, peak
        self.w_input_bytes = 0  # the most one (micro-batch, chunk) kept for its W (docs/pipeline.md)
        self._saved: dict = {}  # (micro, chunk) -> (input, output)
        self._outbox: dict = {}  # (kind, micro, global chunk) -> tensor to send
        self._inbox: dict = {}  # (kind, micro, global chunk) -> (work or None, tensor)
        self._sending: list = []

    # -- the exchange ------------------------------------------------------------------------
    def _peer(self, pp_rank: int) -> int:
        """The neighbour's global rank (the ring wraps: interleaving's last rank feeds rank 0)."""
        return self.comm.next_rank if pp_rank == (self.rank + 1) % self.P else self.comm.prev_rank

    def _post(self) -> None:
        """Post, in the global order, every message that can be posted now."""
        while self.queue:
            _, src, dst, kind, micro, g = self.queue[0]
            key = (kind, micro, g)
            if src == self.rank:
                if key not in self._outbox:
                    break  # not computed yet: later messages wait behind it
                data = self._outbox.pop(key)
                peer = self._peer(dst)
                self._finish_sends(peer)
                comm._record("send", data, group=self.comm.group)
                self._sending.append((dist.isend(data, peer, group=self.comm.group, tag=TAG), data, peer))
            else:
                buf = self.comm._empty()
                self._inbox[key] = (dist.irecv(buf, self._peer(src), group=self.comm.group, tag=TAG), buf)
            self.queue.popleft()
        if is_fake():  # fake works never report completion
            self._sending.clear()
        else:
            self._sending = [s for s in self._sending if not s[0].is_completed()]

    def _finish_sends(self, peer: int) -> None:
        """Wait for the sends still open to ``peer`` before posting another: at most one
        message per link is held beyond its operation. (NCCL reports a finished send;
        gloo only after ``wait()``, so without this a CPU rank would hold every send of the
        step.) Waiting on a posted send cannot deadlock: the receiver posts its receive once
        every earlier message of the global order is posted, and those were all produced by
        operations that need nothing this rank has not sent yet (module docstring)."""
        open_sends = []
        for work, data, to in self._sending:
            if to == peer:
                with comm.blocked():
                    work.wait()
            else:
                open_sends.append((work, data, to))
        self._sending = open_sends

    def _take(self, kind: str, micro: int, g: int) -> torch.Tensor:
        key = (kind, micro, g)
        if key not in self._inbox:
            raise RuntimeError(f"pipeline executor, rank {self.rank}: {kind} of micro-batch {micro} for "
                               f"chunk {g} was never posted (a schedule bug)")
        work, tensor = self._inbox.pop(key)
        if work is not None:
            with comm.blocked():  # waiting for the neighbour stage (straggler reports)
                work.wait()
        if kind == "act":
            tensor.requires_grad_(True)  # a leaf: its .grad is what B sends back
        return tensor

    def _give(self, kind: str, micro: int, g: int, tensor: torch.Tensor) -> None:
        """Hand the output of chunk g to chunk g+1 (act) or g-1 (grad): over the network or,
        when this rank holds that chunk too, through memory."""
        target = g + 1 if kind == "act" else g - 1
        if self.schedule.owner(target)[0] == self.rank:
            local = tensor.detach()
            self._inbox[(kind, micro, target)] = (None, local)
            return
        self._outbox[(kind, micro, target)] = self.comm._checked(tensor)

    # -- the operations ----------------------------------------------------------------------
    def _record(self, op: str, micro: int, chunk: int, fn):
        return self.trace.record(op, micro, chunk, fn) if self.trace else fn()

    def _forward(self, micro: int, c: int) -> None:
        g = self.schedule.global_chunk(self.rank, c)
        x = self._take("act", micro, g) if g > 0 else None
        batch = self.batches[micro]

        def run():
            out = self.forward_fn(self.chunks[c], x, batch)
            if g == self.S - 1:
                loss = self.loss_fn(out, batch)
                self.losses.append(loss.detach())
                return loss * (self.loss_scale / self.M)
            return out

        y = self._record("F", micro, c, run)
        if not self.schedule.forward_only:  # kept for the backward
            self._saved[(micro, c)] = (x, y)
            self.max_in_flight = max(self.max_in_flight, len(self._saved))
        if g < self.S - 1:
            self._give("act", micro, g, y)
            if ("act", micro, g + 1) not in self._inbox:  # sent: only the graph is kept
                _release(y)

    def _backward(self, micro: int, c: int, kind: str) -> None:
        g = self.schedule.global_chunk(self.rank, c)
        grad = self._take("grad", micro, g) if g < self.S - 1 else None
        x, y = self._saved.pop((micro, c))

        def run():
            if kind == "B":
                with self.store.collecting((micro, c)):
                    _backward(y, grad)
            else:
                _backward(y, grad)
            return x.grad if x is not None else None

        gx = self._record(kind, micro, c, run)
        if kind == "B":
            self.w_input_bytes = max(self.w_input_bytes, self.store.stored_bytes((micro, c)))
        if g > 0:
            self._give("grad", micro, g, gx)

    def _weight(self, micro: int, c: int) -> None:
        self._record("W", micro, c, lambda: self.store.run((micro, c)))

    def run(self) -> None:
        split = split_weight_gradients(self.store) if self.schedule.split_backward else contextlib.nullcontext()
        with split:
            for op in self.ops:
                self._post()
                if op.kind == "F":
                    self._forward(op.micro, op.chunk)
                elif op.kind == "W":
                    self._weight(op.micro, op.chunk)
                else:
                    self._backward(op.micro, op.chunk, op.kind)
            self._post()
        with comm.blocked():
            for work, *_ in self._sending:
                work.wait()
        self._sending.clear()
        left = [k for k in self._inbox] + list(self.queue) + list(self.store.pending) + list(self._saved)
        if left:
            raise RuntimeError(f"pipeline executor, rank {self.rank}: the step ended with work left: {left[:4]}")

