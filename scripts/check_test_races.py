#!/usr/bin/env python3
"""Refuse end-to-end tests that race the engine.

A test that needs a request still running when something happens holds it (the hold seam,
`tests.server_util.HOLD`) instead of asking for a long stream, and waits for the pipeline with
`ServerProc.barrier()` instead of sleeping.  So, in the test sources:

- a `max_tokens` / `max_new_tokens` above 64 needs a `# long: <why>` comment on its line or the
  line above (a context to fill, a KV pool to overflow; never "to outlast an event");
- every `time.sleep(` / `asyncio.sleep(` needs a `# clock: <what>` comment on its line or the line
  above, naming the wall-clock time that must pass (a timeout, a scrape interval), never the pipeline.

Usage: python3 scripts/check_test_races.py [paths...]   (default: tests/e2e and tests/*.py)
Exit status 1 and one line per finding when anything is found.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MAX_UNEXPLAINED_TOKENS = 64
TOKENS = re.compile(r"""max_(?:new_)?tokens['"]?\s*[:=]\s*(\d+)""")
SLEEP = re.compile(r"\b(?:time|asyncio)\.sleep\(")


def findings(path: Path) -> list[str]:
    lines = path.read_text().splitlines()
    out = []
    for i, line in enumerate(lines):
        code = line.split("#", 1)[0]
        around = line + "\n" + (lines[i - 1] if i else "")
        for m in TOKENS.finditer(code):
            if int(m.group(1)) > MAX_UNEXPLAINED_TOKENS and "# long:" not in around:
                out.append(
                    f"{path}:{i + 1}: {m.group(0)} asks for more than {MAX_UNEXPLAINED_TOKENS} tokens without "
                    "a '# long: <why>' comment (hold the request instead: tests.server_util.HOLD)"
                )
        if SLEEP.search(code) and "# clock:" not in around:
            out.append(
                f"{path}:{i + 1}: a sleep without a '# clock: <what>' comment (wait for the pipeline with "
                "ServerProc.barrier(), for anything else with wait_until)"
            )
    return out


def default_paths() -> list[Path]:
    return sorted((ROOT / "tests" / "e2e").glob("*.py")) + sorted((ROOT / "tests").glob("*.py"))


def main(argv: list[str]) -> int:
    paths = [Path(a) for a in argv] or default_paths()
    found = [f for p in paths for f in findings(p)]
    print("\n".join(found) if found else f"no racing patterns in {len(paths)} files")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
