"""Workers that need no model stay lean: the results collector and the render router import
neither torch nor transformers, and stay under their memory budget.

torch alone is ~650 MiB resident; the collector only folds status updates into Redis records.
The contract it reads (``schemas.types``, the codec) names tensors without importing torch, and
the codec imports :mod:`schemas.tensors` only for an event that carries one. A module-level
``import torch`` anywhere on the collector's path (its handler, the sweep, the consume loop, the
store errors the retry policy knows, the command line) fails
``test_results_worker_loads_no_model_library``.

The router checks, hashes, recasts and parks encoder inputs without torch: its events decode
into wire tensors (``schemas.wire_tensor``), and the model's fingerprint and processor digest
come from a child process (``runtime.render_keys``). ``test_router_worker_loads_no_model_library``
routes real render events through it and checks what it parked is torch's bf16 cast.

Each check runs in a child process, so that only what it imports counts: the worker against the
test broker and Redis (``tests/lean_probe.py``, ``tests/lean_router_probe.py``), handling real
records before it is measured.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch
from pydantic import SecretStr

from runtime.settings import Settings
from schemas import tensor_ops
from schemas.topics import Topics
from schemas.types import Tensor, TensorLike, TensorRef

ROOT = Path(__file__).resolve().parents[2]
RESULTS_RSS_BUDGET_MB = 150
ROUTER_RSS_BUDGET_MB = 150

_CODEC_PROBE = textwrap.dedent(
    """
    import sys

    from schemas.codec import get_codec
    from schemas.types import (
        DeadLetter, EncodedEvent, ErrorInfo, Features, PrefillEvent, ResultEvent, TensorRef,
    )

    codec = get_codec()
    error = ErrorInfo("rejected", "no", rule="r")
    plain = [
        ResultEvent("r", "fanout", "encoding", error=error, info={"a": "b"}),
        EncodedEvent("h" * 64, "r", "m", "redis://x", "k", "bfloat16", [2, 3]),
        DeadLetter("epd.results", 0, 7, b"r", b"v", "epd-results", error),
    ]
    for ev in plain:
        assert codec.decode(codec.encode(ev)) == ev
    print("torch" in sys.modules, "transformers" in sys.modules)

    import torch

    grid = torch.tensor([[1, 2, 2]])
    ref = TensorRef("redis://x", "k", "float32", [2, 2], 16, "d" * 64)
    meta = {"image": [{"g": grid, "p": ref}]}
    ev = PrefillEvent("r", "m", [1], Features({"image": ["h"]}, {}, None, meta))
    back = codec.decode(codec.encode(ev)).features.mm_metadata["image"][0]
    assert torch.equal(back["g"], grid) and back["p"] == ref
    print("tensors ok")
    """
)


def test_the_codec_loads_torch_only_for_a_tensor() -> None:
    """Events without tensors (the results collector's, dead letters) convert without torch;
    the first event that carries the tensor union (a tensor or a claim check) brings it in, and
    converts as it always did."""
    done = subprocess.run(
        [sys.executable, "-c", _CODEC_PROBE],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.split("\n")[:2] == ["False False", "tensors ok"]


def test_the_tensor_hint_is_never_a_runtime_check() -> None:
    """``schemas.types.Tensor`` stands for ``torch.Tensor`` in hints only: a value tested
    against it (or against ``TensorLike``) raises instead of quietly answering False."""
    with pytest.raises(TypeError, match="type hint only"):
        isinstance(object(), Tensor)
    with pytest.raises(TypeError, match="type hint only"):
        isinstance(TensorRef("s", "k", "uint8", [1], 1, ""), TensorLike)


def test_results_worker_loads_no_model_library(topic_settings: Settings) -> None:
    env = {**os.environ, **topic_settings.to_env(), "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-m", "tests.lean_probe"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    # It did its job: the stage update and the item's encoded mark are in the record.
    assert any(s.startswith("fanout:encoding") for s in report["stages"]), report
    assert "encoded.abababababab" in report["info"], report
    assert report["modules"] == [], f"the results worker imported {report['modules']}"
    assert report["rss_mb"] <= RESULTS_RSS_BUDGET_MB, report


async def test_router_worker_loads_no_model_library(
    topic_settings: Settings, tmp_path: Path
) -> None:
    """The router routes real render events (bf16 transport, pixels claim-checked in Redis)
    without torch or transformers, under its budget; what it parked is torch's cast."""
    from media.sample_images import synthetic_image
    from producers.render import Renderer
    from runtime.kafka import read_topic
    from runtime.model import load_render_info
    from runtime.stores import open_store
    from schemas.codec import get_codec
    from schemas.signing import tensor_digest
    from schemas.types import EncodeEvent

    settings = topic_settings.model_copy(
        update={
            "ec_secret": SecretStr(uuid.uuid4().hex),
            "pixel_dtype": "bf16",
            "inline_limit_bytes": 4096,
            "model": "tiny",
        }
    )
    renderer = Renderer(load_render_info("tiny"), max_image_pixels=4096 * 4096)
    events = [
        renderer.render(
            f"lean-{uuid.uuid4().hex[:12]}",
            prompt="<image> what is it?",
            images=[synthetic_image(112 + 28 * i, 84, seed=i)],
        )
        for i in range(3)
    ]
    path = tmp_path / "render-events"
    path.write_bytes(
        b"".join(len(v).to_bytes(4, "big") + v for v in map(get_codec().encode, events))
    )
    env = {**os.environ, **settings.to_env(), "PYTHONPATH": str(ROOT)}
    done = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "tests.lean_router_probe", str(path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert set(report["stages"]) == {ev.request_id for ev in events}, report
    assert report["modules"] == [], f"the router imported {report['modules']}"
    assert report["rss_mb"] <= ROUTER_RSS_BUDGET_MB, report

    # What it sent: one encode event per request, its pixels parked as torch's bf16 cast.
    pixels: dict[str, Any] = {
        ev.request_id: ev.features.kwargs_data["image"][0]["pixel_values"]  # type: ignore[index]
        for ev in events
    }
    records = await read_topic(settings, Topics(settings.topic_prefix).encode)
    sent = [get_codec().decode(r.value, EncodeEvent) for r in records]
    assert sorted(e.request_id for e in sent) == sorted(pixels)
    async with open_store(settings.embedding_store_url) as store:
        for enc in sent:
            ref = enc.data["pixel_values"]
            want = pixels[enc.request_id].to(torch.bfloat16)
            assert isinstance(ref, TensorRef) and ref.dtype == "bfloat16"
            assert ref.digest == tensor_digest(want)
            assert await store.get_bytes(ref.key) == bytes(tensor_ops.raw_view(want))
            await store.delete(ref.key)
