"""Replay of a `--dump-requests` dump with Locust (`python -m loadtest --replay DIR`: run.py builds
the schedule, readers.py reads the responses, report.py compares them with the recording) and its
export for GuideLLM (`python -m loadtest.replay.export`).  schedule.py holds what they share."""
