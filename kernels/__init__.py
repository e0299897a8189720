"""Triton kernels (installed as ``megalite.kernels``); depend on torch and triton only."""
