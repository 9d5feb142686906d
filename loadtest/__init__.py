"""sightline's load tests: a Locust suite for the streaming API (`python -m loadtest`, docs/loadtest.md).

Locust's own timing stops at the response headers for a stream, so the users here parse
the SSE stream themselves and report TTFT, ITL, TPOT, e2e and output tokens per request
(custom Locust events plus one JSON line per request); the CLI turns those into a
summary, plots, an SLO gate and a reconciliation with the server's `/metrics`.
"""
