"""``runtime.heap.freeze_startup_heap``: what lives at start-up leaves the full collections."""

from __future__ import annotations

import subprocess
import sys


def test_freezing_leaves_a_full_collection_only_the_objects_made_after() -> None:
    # In a child: freezing is for the life of the process.
    code = (
        "import gc\n"
        "import torch\n"
        "from runtime.heap import freeze_startup_heap\n"
        "before = len(gc.get_objects())\n"
        "frozen = freeze_startup_heap()\n"
        "after = len(gc.get_objects())\n"
        "gc.disable()\n"  # no automatic pass frees the cycles before the count
        "for _ in range(1000):\n"
        "    a = []; a.append(a)\n"  # a cycle only the collector can free
        "del a\n"
        "print(before, frozen, after, gc.collect())\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    ).stdout.split()
    before, frozen, after, collected = map(int, out)
    assert frozen >= before * 0.9  # torch's modules and classes: out of the walk
    assert after < before / 10
    assert collected >= 1000  # the request's own garbage is still collected
