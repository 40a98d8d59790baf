"""Video end to end over a real Tansu broker and a real Redis, workers in separate processes:
an MP4 (PyAV) and an image in one request; the encode topic carries ``pixel_values_videos``
(inline or as a claim check), the prefill topic only ``video_grid_thw``; tokens match
``model.generate``. (The ``epd verify`` video cases run in ``test_pipeline_e2e``.)"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from epd.local_pipeline import LocalRun, local_pipeline
from gpu_workers.oracle import monolithic_inputs, monolithic_video_inputs
from media.sample_images import synthetic_image
from media.sample_videos import synthetic_mp4
from runtime.kafka import read_topic
from runtime.settings import Settings
from schemas.codec import get_codec
from schemas.types import EncodeEvent, PrefillEvent, SamplingParams, TensorRef

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
async def pipeline(
    settings: Settings, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[LocalRun]:
    log_dir: Path = tmp_path_factory.mktemp("worker-logs")
    async with local_pipeline(
        settings, spawn_workers=True, log_dir=log_dir, kinds=("results", "encode", "prefill")
    ) as run:
        yield run


async def test_video_and_image_split_across_topics_with_parity(pipeline: LocalRun) -> None:
    from gpu_workers.oracle import generate_monolithic
    from runtime.model import load_model

    run = pipeline
    mp4 = synthetic_mp4(16, 112, 84, fps=8, seed=uuid.uuid4().int % 1000)
    ev, stats = await run.submitter.submit(
        prompt="Watch <video> then look at <image>.",
        videos=[mp4],
        images=[synthetic_image(84, 56, seed=5)],
        sampling=SamplingParams(max_tokens=6, ignore_eos=True),
        cache_salt=uuid.uuid4().hex,
    )
    wait = asyncio.create_task(run.submitter.wait(ev.request_id, timeout_s=240))
    while not wait.done():
        assert run.workers is not None
        run.workers.check_alive()
        await asyncio.wait([wait], timeout=1.0)
    rec = await wait
    assert rec.status == "completed", rec

    bundle = await asyncio.to_thread(load_model, "tiny", device="cpu")
    ids, pv, grid = monolithic_inputs(ev)
    want = await asyncio.to_thread(
        lambda: generate_monolithic(
            bundle, ids, pv, grid, 6, ignore_eos=True, **monolithic_video_inputs(ev)
        )
    )
    assert rec.token_ids == want

    codec, prefix = get_codec(), run.settings.topic_prefix
    encodes = [
        e
        for r in await read_topic(run.settings, f"{prefix}.encode")
        if (e := codec.decode(r.value, EncodeEvent)).request_id == ev.request_id
    ]
    video = [e for e in encodes if e.modality == "video"]
    assert len(video) == 1 and {e.modality for e in encodes} == {"video", "image"}
    pvv = video[0].data["pixel_values_videos"]
    src = ev.features.kwargs_data["video"][0]["pixel_values_videos"]  # type: ignore[index]
    assert isinstance(pvv, TensorRef) or tuple(pvv.shape) == tuple(src.shape)  # type: ignore[union-attr]
    assert set(video[0].data) == {"pixel_values_videos", "video_grid_thw"}

    prefills = [
        p
        for r in await read_topic(run.settings, f"{prefix}.prefill")
        if (p := codec.decode(r.value, PrefillEvent)).request_id == ev.request_id
    ]
    assert len(prefills) == 1
    f = prefills[0].features
    assert f.kwargs_data is None and f.mm_metadata is not None
    assert [set(m or {}) for m in f.mm_metadata["video"]] == [{"video_grid_thw"}]
    assert [set(m or {}) for m in f.mm_metadata["image"]] == [{"image_grid_thw"}]
    vgrid = f.mm_metadata["video"][0]["video_grid_thw"].tolist()  # type: ignore[index,union-attr]
    print(
        f"\nvideo request: encode topic {stats.encode_bytes} B, prefill topic "
        f"{stats.prefill_bytes} B, video grid {vgrid}"
    )
