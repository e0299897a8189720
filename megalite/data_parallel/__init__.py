"""Data parallelism: bucketed, overlapped gradient reduction and ZeRO stages 0-3."""
