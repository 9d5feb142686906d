"""The wire contract every process shares: messages (`io_struct`), sampling parameters
(`sampling_params`) and per-request stamps.

A leaf: it imports neither torch nor telemetry nor any serving module, so the front end
and the Detokenizer can speak it without loading the engine, and `telemetry` can depend
on it without depending on the processes it observes.
"""
