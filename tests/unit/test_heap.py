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


def test_an_api_process_freezes_its_heap_once_its_app_has_started() -> None:
    """``process_app`` (every ``epd api`` worker process, ``--workers N`` included, and ``epd
    stack``) wraps the app's lifespan: the app's own start first, then the freeze; the app's
    own stop on the way out. Run with the app's own lifespan stubbed (no services), through
    Starlette's lifespan protocol as uvicorn drives it."""
    code = (
        "import asyncio, contextlib, gc\n"
        "import frontend.api.app as app_mod\n"
        "from frontend.api import process_app\n"
        "from runtime.settings import Settings\n"
        "seen = []\n"
        "real = app_mod.create_app\n"
        "def create(settings):\n"
        "    app = real(settings)\n"
        "    @contextlib.asynccontextmanager\n"
        "    async def own(app):\n"
        "        seen.append(('started', gc.get_freeze_count()))\n"
        "        yield\n"
        "        seen.append(('stopped', gc.get_freeze_count()))\n"
        "    app.router.lifespan_context = own\n"
        "    return app\n"
        "import frontend.api as api\n"
        "api.create_app = create\n"
        "app = process_app(Settings())\n"
        "async def drive():\n"
        "    sent = [{'type': 'lifespan.startup'}, {'type': 'lifespan.shutdown'}]\n"
        "    said = []\n"
        "    async def receive():\n"
        "        return sent.pop(0)\n"
        "    async def send(message):\n"
        "        said.append(message['type'])\n"
        "        if message['type'] == 'lifespan.startup.complete':\n"
        "            seen.append(('up', gc.get_freeze_count()))\n"
        "    scope = {'type': 'lifespan', 'asgi': {'version': '3.0'}, 'state': {}}\n"
        "    await app(scope, receive, send)\n"
        "    return said\n"
        "said = asyncio.run(drive())\n"
        "print(said, seen)\n"
        "assert said == ['lifespan.startup.complete', 'lifespan.shutdown.complete'], said\n"
        "assert seen[0] == ('started', 0), seen\n"
        "assert seen[1][0] == 'up' and seen[1][1] > 10000, seen\n"
        "assert seen[2][0] == 'stopped', seen\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
