"""The Scheduler process: continuous batching over a real torch model (`scheduler.py` its loop), the KV pool and
prefix cache, sampling, grammars and the tests' seams."""
