"""`scripts/check_test_races.py`: no e2e test asks for a long stream or sleeps for the pipeline
without saying why, and the checker itself catches both."""

from __future__ import annotations

from tests.helpers import script_module


def _checker():
    return script_module("check_test_races")


def test_no_e2e_test_races_the_engine():
    checker = _checker()
    found = [f for p in checker.default_paths() for f in checker.findings(p)]
    assert not found, "\n".join(found)


def test_the_checker_finds_long_streams_and_bare_sleeps(tmp_path):
    checker = _checker()
    bad = tmp_path / "test_bad.py"
    bad.write_text(
        'body = {"prompt": "x", "max_tokens": 600}\n'
        'sp = {"max_new_tokens": 65}\n'
        "time.sleep(0.5)\n"
        "await asyncio.sleep(1)  # for the messages\n"
        'ok = {"max_tokens": 64}\n'
        '# long: fills the 2048-token context on purpose\nfill = {"max_tokens": 2000}\n'
        "time.sleep(2)  # clock: past the 1 s timeout\n"
    )
    lines = [f.split(":")[1] for f in checker.findings(bad)]
    assert lines == ["1", "2", "3", "4"]
