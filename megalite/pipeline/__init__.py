"""Pipeline parallelism: stage partitioning, point-to-point exchange, schedules."""
