"""Triton kernels (installed as ``megalite.kernels``); depend on torch and triton only.

- ``flash_attention``: flash attention forward with the log-sum-exp, autograd wrapper
  (backward in ``flash_attention_bwd``); ``attention_reference``: the torch reference,
  ``merge_attention`` (exact combination of partial attentions, for ring attention) and the
  torch block forward/backward with the kernels' signatures (ring attention off the GPU).
- ``norms``: fused LayerNorm / RMSNorm forward and backward.
- ``cross_entropy``: softmax cross-entropy streamed over the vocabulary, with the per-slice
  statistics a vocab-parallel loss combines over tensor-parallel ranks.

Import the modules themselves: they compile their kernels at import, for a GPU, or for the
CPU interpreter when ``TRITON_INTERPRET=1`` is set before the import.
"""
