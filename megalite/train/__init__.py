"""The training run: the step, the loop, the entry point and its startup checks."""
