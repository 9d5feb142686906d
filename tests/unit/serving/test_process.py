"""`serving.process.freeze_heap` in a real interpreter of its own (it freezes the whole heap, so
never in the test process): what was alive is out of the collector's reach, garbage is not kept,
and what is made afterwards is collected as usual."""

from __future__ import annotations

import json
import subprocess
import sys

SCRIPT = r"""
import gc, json, weakref
from serving.process import freeze_heap

class Node:
    pass

def cycle():
    a, b = Node(), Node()
    a.other, b.other = b, a
    return a

kept = cycle()             # alive at the freeze
dead = weakref.ref(cycle())  # garbage at the freeze: collected, not frozen
freeze_heap()
kept_tracked = any(o is kept for o in gc.get_objects())
later = weakref.ref(cycle())  # garbage made afterwards
found = gc.collect()
print(json.dumps({"frozen": gc.get_freeze_count(), "dead_collected": dead() is None,
                  "kept_in_generations": kept_tracked, "later_collected": later() is None, "found": found}))
"""


def test_the_startup_heap_is_frozen_and_later_garbage_still_collected():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, check=True, timeout=60)
    got = json.loads(out.stdout)
    assert got["frozen"] > 1000  # the interpreter's own objects and the imported modules
    assert got["dead_collected"]  # the collection before the freeze freed the cycle that was already garbage
    assert not got["kept_in_generations"]  # frozen: no collection walks it again, nor the one at exit
    assert got["later_collected"] and got["found"] >= 2  # a cycle made after the freeze is collected as before
