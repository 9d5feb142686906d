"""Telemetry for sightline: clocks now; metrics, tracing and logs as the issues land."""
