"""A claim-checked encoder input lost with the store (issue 21, defect 9) is a failure of ours
with its own code (``failed`` / ``input-lost``, like ``embedding-lost``), never a rejection of
the user's valid input, and nothing of it reaches the DLQ."""

from __future__ import annotations

import uuid

import pytest

from gpu_workers.context import WorkerContext
from gpu_workers.encode import EncodeWorker
from media.sample_images import synthetic_image
from producers.fanout import FanOut
from producers.render import Renderer
from runtime.model import ModelBundle, load_model
from runtime.publisher import InMemoryPublisher
from runtime.settings import Settings
from runtime.stores.local import LocalStore
from schemas.codec import decode, encode
from schemas.topics import Topics
from schemas.types import ResultEvent, TensorRef


@pytest.fixture(scope="module")
def bundle() -> ModelBundle:
    return load_model("tiny", device="cpu")


async def test_a_lost_claim_check_fails_the_request_as_ours(bundle: ModelBundle) -> None:
    cfg = Settings(inline_limit_bytes=16 * 1024, allow_unsigned=True, ec_namespace="ec-lost")
    store = LocalStore(f"local://input-lost-{uuid.uuid4().hex[:12]}")
    ev = Renderer(bundle, max_image_pixels=4096 * 4096).render(
        "req-lost", prompt="describe <image>", images=[synthetic_image(112, 112, seed=9)]
    )
    [enc] = (await FanOut(cfg, store, bundle.render_info()).plan(ev)).encode
    enc = decode(encode(enc))  # as the encode worker receives it
    ref = enc.data["pixel_values"]
    assert isinstance(ref, TensorRef)
    await store.delete(ref.key)  # Redis restarted empty (or the claim's TTL ran out)

    pub = InMemoryPublisher()
    worker = EncodeWorker(WorkerContext(cfg, bundle, store, pub))
    try:
        await worker.handle(enc)  # reported, not raised: the consume loop would DLQ a raise
    finally:
        await worker.close()
        await store.close()
    results = [
        e for e in pub.events(Topics(cfg.topic_prefix).results) if isinstance(e, ResultEvent)
    ]
    assert [(r.request_id, r.status) for r in results] == [("req-lost", "failed")]
    err = results[0].error
    assert err is not None
    assert (err.code, err.rule, err.modality, err.item, err.field) == (
        "input-lost",
        "claim-check",
        "image",
        0,
        "pixel_values",
    )
    assert "resubmit" in err.message
    assert worker.items_encoded == 0 and worker.encoder_calls == 0
