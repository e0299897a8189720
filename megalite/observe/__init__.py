"""Observability: timers, host-sync counting, memory tracking, the log line, MFU, profiles, plots."""
