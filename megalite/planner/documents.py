"""Packed documents in the planner: the attention work they leave, and the step's batch on the device.

**Attention FLOPs.** Training counts ``6 N + 12 L h s`` model FLOPs per token
(:func:`megalite.model.counting.flops_per_token`): 6 per parameter a token meets, plus the scores
(Q K^T) and the weighted values (P V) of attention, 2 matmuls of s x h per token per layer,
x2 FLOPs, x3 with backward. With ``--reset-attention-mask`` a query attends only its own
document, and megalite's Triton kernels skip the key tiles no document spans, so the attention
work done is the documents' causal squares: s becomes the mean over tokens of their document's
length, ``N_bar = sum_d N_d^2 / s`` (:func:`megalite.observe.monitor.attended_length` reads it from a
batch). The planner takes a typical document length N and assumes equal documents of N tokens:
``N_bar = N`` (a document of N tokens holds N tokens that each attend within N), so attention
costs ``12 L h N`` per token instead of ``12 L h s``, and saves ``12 L h (s - N)`` per token,
the fraction ``1 - N/s`` of the attention FLOPs. The MLP and projections (the ``6 N`` term) are
unchanged. Real corpora mix lengths, and ``N_bar`` weighs long documents by their length (a 4k
document among a hundred 40-token ones dominates it): pass the length-weighted mean when known.

**The step's batch** (the "data" entry of the memory estimate). ``train/pretrain.py`` reads the step's
M micro-batches of b x s tokens from the host and moves them all to the device before the first
forward (``megalite.device.to_device``); they live until the step ends. Per token: tokens 8,
labels 8, position_ids 8 (int64), loss_mask 4 (float32) = 28 bytes, and with
``--reset-attention-mask`` doc_start and doc_end 4 + 4 (int32) = 36 bytes. Every pipeline stage
holds the whole batch (pretrain moves every key on every rank). Under context parallelism the
batch arrives whole and :func:`megalite.train.step.context_parallel_batches` slices a copy of each
micro-batch for the rank at the start of the step (``torch.cat`` of the rank's two chunks): s/C
tokens of every key but the documents' arrays, which stay whole and are not copied
(:data:`megalite.context_parallel.data.WHOLE_SEQUENCE_KEYS`), plus a 4-byte loss denominator
(N/C) per micro-batch. So ``data = M b s (28 + 8 [documents]) + [C > 1] M (28 b s / C + 4)``.
It is small: 7B with s = 4096, b = 1, M = 32 holds 3.7 MB.

The dry run (``--track-memory``) counts the same bytes: pretrain registers the step's device
batches with the tracker as ``data``, and the CP slices are made inside the step.
"""
from __future__ import annotations

from dataclasses import dataclass

from megalite.config import ModelConfig
from megalite.model.counting import attended_flops, flops_per_token
from megalite.observe.monitor import attended_length

# Bytes per token of each key of a micro-batch (megalite.data.builder's dtypes).
BATCH_BYTES = {"tokens": 8, "labels": 8, "position_ids": 8, "loss_mask": 4}
DOCUMENT_BYTES = {"doc_start": 4, "doc_end": 4}  # with --reset-attention-mask; whole under CP
LOSS_DENOMINATOR_BYTES = 4  # under CP: the micro-batch's trained tokens per CP rank, one fp32 scalar


def token_bytes(documents: bool = False) -> int:
    """Bytes per token of one micro-batch on the device: 28, or 36 with the documents' arrays."""
    return sum(BATCH_BYTES.values()) + (sum(DOCUMENT_BYTES.values()) if documents else 0)


def batch_bytes(seq_length: int, micro: int, num_micro: int, cp: int = 1, documents: bool = False) -> float:
    """The step's micro-batches on one rank's device (module docstring):
    ``M b s (28 + 8 [documents]) + [C > 1] M (28 b s / C + 4)``."""
    whole = num_micro * micro * seq_length * token_bytes(documents)
    if cp == 1:
        return float(whole)
    sliced = num_micro * (micro * seq_length / cp * sum(BATCH_BYTES.values()) + LOSS_DENOMINATOR_BYTES)
    return whole + sliced


@dataclass(frozen=True)
class DocumentFlops:
    """Model FLOPs per token over the whole sequence and with documents of mean attended length
    ``attended`` (``N_bar``), and the attention FLOPs (``12 L h length``) of each."""
    seq_length: int
    attended: float
    whole: float  # FLOPs per token, attention over the whole sequence: 6 N + 12 L h s
    documents: float  # with documents: 6 N + 12 L h N_bar
    attention_whole: float  # 12 L h s
    attention_documents: float  # 12 L h N_bar

    @property
    def saved(self) -> float:
        """Attention FLOPs per token the documents save: 12 L h (s - N_bar)."""
        return self.attention_whole - self.attention_documents

    @property
    def saved_fraction(self) -> float:
        """Of the attention FLOPs: 1 - N_bar / s."""
        return self.saved / self.attention_whole

    @property
    def saved_of_total(self) -> float:
        """Of all model FLOPs (the whole-sequence count)."""
        return self.saved / self.whole


def document_flops(m: ModelConfig, attended: float) -> DocumentFlops:
    """FLOPs per token both ways, from :func:`megalite.model.counting.flops_per_token` (what MFU counts)."""
    whole, docs = flops_per_token(m), flops_per_token(m, attended)
    per_length = 3.0 * attended_flops(m)  # training attention FLOPs per token per attended token: 12 L h
    return DocumentFlops(m.seq_length, float(attended), whole, docs, per_length * m.seq_length, per_length * attended)


def format_flops(x: float) -> str:
    """FLOPs with three significant digits and a unit: 46.0 GFLOP, 1.27 PFLOP, 535 kFLOP."""
    for unit, scale in (("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6), ("kFLOP", 1e3)):
        if x >= scale:
            v = x / scale
            return f"{v:.{2 if v < 10 else 1 if v < 100 else 0}f} {unit}"
    return f"{x:.0f} FLOP"


def plan_lines(m: ModelConfig, document_length: int, tokens_per_step: int) -> list[str]:
    """The planner's report with packed documents of ``document_length`` tokens (equal documents:
    ``N_bar = N``): model FLOPs per token and per step both ways, and the attention FLOPs saved."""
    f, flops = document_flops(m, document_length), format_flops
    L, h, s, n = m.num_layers, m.hidden_size, m.seq_length, document_length
    return [
        (f"Packed documents (--reset-attention-mask, documents of {n} tokens in sequences of {s}): attention "
         f"over each document only, taken as equal documents of {n}: 12 L h N = 12 x {L} x {h} x {n} per token "
         f"instead of 12 L h s = 12 x {L} x {h} x {s}."),
        (f"  model FLOPs per token (6 N + 12 L h length): whole sequence {flops(f.whole)}, with documents "
         f"{flops(f.documents)}; per step of {tokens_per_step:,} tokens: {flops(f.whole * tokens_per_step)} "
         f"against {flops(f.documents * tokens_per_step)}."),
        (f"  attention FLOPs saved: {flops(f.saved)} per token, {flops(f.saved * tokens_per_step)} per step: "
         f"{f.saved_fraction:.1%} of the attention FLOPs (1 - N/s), {f.saved_of_total:.1%} of the model FLOPs."),
    ]


def dry_run_line(m: ModelConfig, host_batches: list[dict]) -> str | None:
    """The attention work of a dry run's batch (host micro-batches with ``doc_start``/``doc_end``),
    or None without documents: the mean attended length against s and the FLOPs per token both ways."""
    attended = attended_length(host_batches)
    if attended is None:
        return None
    f = document_flops(m, attended)
    starts = sum(int((b["doc_start"][:, 1:] != b["doc_start"][:, :-1]).sum()) + b["doc_start"].shape[0]
                 for b in host_batches)
    rows = sum(b["doc_start"].shape[0] for b in host_batches)
    return (f"packed documents: this batch's mean attended length {attended:.1f} of s = {m.seq_length} tokens "
            f"({starts / rows:.1f} documents per sample); model FLOPs per token {format_flops(f.documents)} with "
            f"documents against {format_flops(f.whole)} over the whole sequence (attention {f.saved_fraction:.1%} less)")
