"""bench.admission's table: one row per policy and phase, each group's tok/s where it has clients."""

from __future__ import annotations

from bench.admission import rows


def test_rows_show_each_group_that_ran():
    r = {
        "peak_running": 16,
        "mean_running": 15.2,
        "retractions": 2,
        "recomputed_tokens": 3,
        "without": {"tok_s": 34.1, "tok_s_per_client": 4.26, "429": 0},
        "with": {"tok_s": 34.0, "tok_s_per_client": 4.25, "429": 1},
    }
    only = {k: v for k, v in r.items() if k != "with"}
    lines = rows({"estimate": {"mixed": r}, "reserve": {"without": only}})
    assert lines[2] == "| estimate | mixed | 16 | 15.2 | 34.1 (4.26) | 34.0 (4.25) | 1 | 2 (3) |"
    assert lines[3] == "| reserve | without | 16 | 15.2 | 34.1 (4.26) | – | 0 | 2 (3) |"
