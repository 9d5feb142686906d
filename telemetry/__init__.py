"""Telemetry for sightline, shared by every process: clocks, metrics, tracing, per-request telemetry, logs."""
