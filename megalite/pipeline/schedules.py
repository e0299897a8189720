"""Pipeline schedules over M micro-batches: GPipe (reference), 1F1B, interleaved 1F1B.

A *forward step* runs one model chunk on one micro-batch: it embeds (first stage) or
takes the activation received from the previous stage, and either returns the activation
to send on or (last stage) the micro-batch loss / M. A *backward step* back-propagates
the gradient received from the next stage (or the loss) and returns the gradient of the
received activation, to send back.

- GPipe: all M forwards, then all M backwards. Simple; M micro-batches in flight.
- 1F1B: stage p runs w = min(P - p - 1, M) warm-up forwards, then alternates one forward
  and one backward, then w cool-down backwards. At most P micro-batches in flight on
  stage 0, and the bubble is the same as GPipe's: (P - 1) / (M + P - 1).
- Interleaved 1F1B: each rank holds V chunks; micro-batches go round the ring V times in
  groups of P, shrinking the bubble to (P - 1) / (V*M + P - 1). Needs M % P == 0.

After an activation has been sent, its storage is released (only its autograd node is
kept for backward), so a stage keeps what backward needs and nothing more. Gradient
reduction over data parallelism happens once per step, after the schedule, never per
micro-batch. Every step is recorded in a :class:`Trace` when one is given.
"""
from __future__ import annotations

from collections import deque

import torch
from torch.autograd.variable import Variable

from megalite.pipeline.p2p import PipeComm
from megalite.timers import Clock


class Trace:
    """(op, micro-batch, chunk, start, end) for every step of this rank, in perf_counter
    seconds. On a GPU the marks are CUDA events (see :mod:`megalite.timers`), resolved to
    times when ``events`` is first read, so the trace shows when the device ran each step."""

    def __init__(self, clock: Clock | None = None):
        self.clock = clock or Clock()
        self._marks: list[tuple[str, int, int, object, object]] = []

    def record(self, op: str, micro: int, chunk: int, fn):
        start = self.clock.mark()
        result = fn()
        self._marks.append((op, micro, chunk, start, self.clock.mark()))
        return result

    @property
    def events(self) -> list[tuple[str, int, int, float, float]]:
        seconds = self.clock.seconds
        return [(op, micro, chunk, seconds(a), seconds(b)) for op, micro, chunk, a, b in self._marks]


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


class PipelineRunner:
    """Runs one schedule over this rank's model chunks for one step's micro-batches.

    ``forward_fn(chunk_module, input_tensor, batch)`` returns the activation to send or,
    on the loss chunk, the per-token losses; the runner turns losses into the scaled
    micro-batch loss and collects the unscaled losses in ``self.losses``.
    """

    def __init__(self, chunks, micro_batches, grid, shape, forward_fn, loss_fn, trace: Trace | None = None,
                 dtype=torch.float32, loss_scale: float = 1.0, device="cpu"):
        self.chunks, self.batches, self.grid = chunks, micro_batches, grid
        self.P, self.V, self.M = grid.layout.pp, len(chunks), len(micro_batches)
        self.rank = grid.pp_rank
        self.forward_fn, self.loss_fn, self.loss_scale = forward_fn, loss_fn, loss_scale
        self.comm = PipeComm(grid, shape, dtype, device)
        self.trace = trace
        self.losses: list[torch.Tensor] = []
        self.max_in_flight = 0  # micro-batches whose backward is still pending, peak
        self._next_micro = [0] * self.V
        self._next_micro_bwd = [0] * self.V

    # -- the steps ----------------------------------------------------------------------------
    def _is_first(self, chunk: int) -> bool:
        return self.rank == 0 and chunk == 0

    def _is_last(self, chunk: int) -> bool:
        return self.rank == self.P - 1 and chunk == self.V - 1

    def forward_step(self, chunk: int, input_tensor):
        micro = self._next_micro[chunk]
        self._next_micro[chunk] += 1
        batch = self.batches[micro]

        def run():
            out = self.forward_fn(self.chunks[chunk], input_tensor, batch)
            if self._is_last(chunk):
                loss = self.loss_fn(out, batch)
                self.losses.append(loss.detach())
                return loss * (self.loss_scale / self.M)
            return out

        out = self.trace.record("F", micro, chunk, run) if self.trace else run()
        return out

    def backward_step(self, chunk: int, input_tensor, output, output_grad):
        micro = self._next_micro_bwd[chunk]
        self._next_micro_bwd[chunk] += 1

        def run():
            _backward(output, output_grad)
            return input_tensor.grad if input_tensor is not None else None

        return self.trace.record("B", micro, chunk, run) if self.trace else run()

    def _track(self, in_flight: int) -> None:
        self.max_in_flight = max(self.max_in_flight, in_flight)

    # -- GPipe: all forward, then all backward ---------------------------------------------------
    def run_gpipe(self) -> None:
        assert self.V == 1
        saved = deque()
        for _ in range(self.M):
            x = None if self._is_first(0) else self.comm.recv_forward()
            y = self.forward_step(0, x)
            if not self._is_last(0):
                self.comm.send_forward(y)
                _release(y)
            saved.append((x, y))
            self._track(len(saved))
        for _ in range(self.M):
            x, y = saved.popleft()
            g = None if self._is_last(0) else self.comm.recv_backward()
            gx = self.backward_step(0, x, y, g)
            if not self._is_first(0):
                self.comm.send_backward(gx)

    # -- 1F1B ----------------------------------------------------------------------------------
    def run_1f1b(self) -> None:
        assert self.V == 1
        first, last = self._is_first(0), self._is_last(0)
        warmup = min(self.P - self.rank - 1, self.M)
        steady = self.M - warmup
        saved = deque()
        for _ in range(warmup):
            x = None if first else self.comm.recv_forward()
            y = self.forward_step(0, x)
            if not last:
                self.comm.send_forward(y)
                _release(y)
            saved.append((x, y))
            self._track(len(saved))
        x = None if first or steady == 0 else self.comm.recv_forward()
        for i in range(steady):
            y = self.forward_step(0, x)
            saved.append((x, y))
            self._track(len(saved))
            # Send this forward's output and receive the gradient for the oldest one, together.
            g = None if last else self.comm.communicate(send_next=y, recv_next=True)[1]
            if not last:
                _release(y)
            x_old, y_old = saved.popleft()
            gx = self.backward_step(0, x_old, y_old, g)
            if first:
                x = None
            elif i == steady - 1:
                self.comm.send_backward(gx)
            else:  # send the gradient back and receive the next forward input, together
                x = self.comm.communicate(send_prev=gx, recv_prev=True)[0]
        for _ in range(warmup):
            x_old, y_old = saved.popleft()
            g = None if last else self.comm.recv_backward()
            gx = self.backward_step(0, x_old, y_old, g)
            if not first:
                self.comm.send_backward(gx)

    # -- interleaved 1F1B ------------------------------------------------------------------------
    def _chunk_of(self, k: int, forward: bool) -> int:
        """Model chunk of the k-th forward (or backward) step: groups of P micro-batches
        per chunk, chunks in order going forward and in reverse going backward."""
        chunk = (k % (self.P * self.V)) // self.P
        return chunk if forward else self.V - 1 - chunk

    def run_interleaved(self) -> None:
        P, V, M, rank = self.P, self.V, self.M, self.rank
        total = M * V
        if M == P:  # too few micro-batches for a steady state: everything is warm-up
            warmup = total
        else:
            warmup = min((P - rank - 1) * 2 + (V - 1) * P, total)
        steady = total - warmup
        inputs = [deque() for _ in range(V)]
        outputs = [deque() for _ in range(V)]
        grads = [deque() for _ in range(V)]
        first_rank, last_rank = rank == 0, rank == P - 1

        def forward(k):
            c = self._chunk_of(k, True)
            if self._is_first(c) and len(inputs[c]) == len(outputs[c]):
                inputs[c].append(None)  # the first chunk embeds: no received input
            # FIFO: inputs of micro-batches already run forward (and not yet backward) come first.
            y = self.forward_step(c, inputs[c][len(outputs[c])])
            outputs[c].append(y)
            self._track(sum(len(o) for o in outputs))
            return None if self._is_last(c) else y

        def backward(k):
            c = self._chunk_of(k, False)
            if self._is_last(c) and not grads[c]:
                grads[c].append(None)  # the loss chunk starts backward from the loss
            gx = self.backward_step(c, inputs[c].popleft(), outputs[c].popleft(), grads[c].popleft())
            return None if self._is_first(c) else gx

        def released(y):
            if y is not None:
                _release(y)

        # The first stage's first chunk needs no input; every other forward input is
        # received one tick ahead, in the same batch as the previous tick's send.
        if not first_rank:
            inputs[0].append(self.comm.recv_forward())
        for k in range(warmup):
            y = forward(k)
            next_chunk = self._chunk_of(k + 1, True)
            recv_prev = not (first_rank and next_chunk == 0) and k != total - 1
            if k == warmup - 1 and steady > 0:
                # Last warm-up tick: also receive the gradient for the first backward.
                recv_next = not last_rank
                x, g = self.comm.communicate(send_next=y, recv_prev=recv_prev, recv_next=recv_next)
                if recv_next:
                    grads[V - 1].append(g)
            else:
                x, _ = self.comm.communicate(send_next=y, recv_prev=recv_prev)
            released(y)
            if recv_prev:
                inputs[next_chunk].append(x)

        for i in range(steady):
            fk, bk = i + warmup, i
            y = forward(fk)
            gx = backward(bk)
            # Which chunk the input received now is for. The first rank receives, via the
            # ring, the last rank's output of P-1 ticks ago, for the following chunk.
            recv_prev = True
            if first_rank:
                prev_chunk = self._chunk_of(fk - (P - 1), True)
                recv_prev = prev_chunk != V - 1
                next_fwd_chunk = prev_chunk + 1
            else:
                next_fwd_chunk = self._chunk_of(fk + 1, True)
            recv_next = True
            if last_rank:
                prev_chunk = self._chunk_of(bk - (P - 1), False)
                recv_next = prev_chunk != 0
                next_bwd_chunk = prev_chunk - 1
            else:
                next_bwd_chunk = self._chunk_of(bk + 1, False)
            if i == steady - 1:
                recv_prev = False
            x, g = self.comm.communicate(send_next=y, send_prev=gx, recv_prev=recv_prev, recv_next=recv_next)
            released(y)
            if recv_prev:
                inputs[next_fwd_chunk].append(x)
            if recv_next:
                grads[next_bwd_chunk].append(g)

        if steady == 0 and not last_rank:
            grads[V - 1].append(self.comm.recv_backward())
        for k in range(steady, total):
            gx = backward(k)
            next_chunk = self._chunk_of(k + 1, False)
            recv_next = not (last_rank and next_chunk == V - 1) and k != total - 1
            _, g = self.comm.communicate(send_prev=gx, recv_next=recv_next)
            if recv_next:
                grads[next_chunk].append(g)

    def run(self, schedule: str) -> None:
        if self.V > 1:
            self.run_interleaved()
        elif schedule == "gpipe":
            self.run_gpipe()
        else:
            self.run_1f1b()


def forward_only(chunks, micro_batches, grid, shape, forward_fn, loss_fn, dtype=torch.float32,
                 device="cpu", schedule: str = "1f1b") -> list:
    """Evaluation: every micro-batch goes through all global chunks in order; no backward.
    Activations go to the next rank, except on ZBV's second leg (chunks P..2P-1), which runs
    back towards rank 0; a chunk whose successor is on the same rank hands over in memory."""
    from megalite.pipeline.op_lists import owner
    from megalite.pipeline.schedule_kinds import schedule as describe

    comm = PipeComm(grid, shape, dtype, device)
    P, V, rank = grid.layout.pp, len(chunks), grid.pp_rank
    v_shape = describe(schedule).v_shape
    S = P * V
    losses = []
    with torch.no_grad():
        for batch in micro_batches:
            held = None
            for g in range(S):
                r, c = owner(schedule, P, V, g)
                if r != rank:
                    continue
                backwards = v_shape and g >= P  # the V's second leg
                if g == 0:
                    x = None
                elif owner(schedule, P, V, g - 1)[0] == rank:
                    x = held
                else:
                    x = comm.communicate(recv_next=True)[1] if backwards else comm.recv_forward()
                y = forward_fn(chunks[c], x, batch)
                if g == S - 1:
                    losses.append(loss_fn(y, batch))
                elif owner(schedule, P, V, g + 1)[0] == rank:
                    held = y
                elif v_shape and g + 1 >= P:
                    comm.communicate(send_prev=y)
                else:
                    comm.send_forward(y)
    return losses
