"""The EC connector under vLLM 0.33.0's own interface (vLLM's code from ``tools/vllm-side.sh``;
skipped where it is not assembled, required in CI: :mod:`tests.vllm_side`).

The connector is made by vLLM's ``ECConnectorFactory`` from a real ``ECTransferConfig`` naming it
by ``ec_connector_module_path``, and driven in the order vLLM's scheduler (``scheduler.py``:
``ensure_cache_available``, ``has_cache_item``, ``update_state_after_alloc``,
``build_connector_meta``, ``take_unavailable_requests``, ``request_finished``) and model runner
(``ECConnectorModelRunnerMixin``, vLLM's own code, run here: ``start_load_caches`` inside
``maybe_get_ec_connector_output``, ``save_caches`` through ``maybe_save_ec_to_connector``,
``get_finished``) call it, with real tensors through a real Redis and a real Redis Cluster.

Two stand-ins, because vLLM's own types need ``xgrammar`` (a compiled package the side folder
does not carry) to build on a CPU machine: ``SmallestVllmConfig`` holds the two fields of
``VllmConfig`` the connector reads (``ec_transfer_config``, a real one, and ``model_config``'s
dtype and vision config), and ``Req`` the fields of ``vllm.v1.request.Request`` it reads (its
``mm_features`` are vLLM's own ``MultiModalFeatureSpec``, and ``get_num_encoder_embeds`` is
``Request``'s one line).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest
import redis.asyncio as aioredis
import torch

from tests.vllm_side import use_vllm

use_vllm()

from vllm.config import ECTransferConfig  # noqa: E402
from vllm.distributed.ec_transfer import ec_transfer_state  # noqa: E402
from vllm.distributed.ec_transfer.ec_connector.base import (  # noqa: E402
    ECConnectorBase,
    ECConnectorRole,
)
from vllm.distributed.ec_transfer.ec_connector.factory import ECConnectorFactory  # noqa: E402
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange  # noqa: E402
from vllm.v1.core.sched.output import SchedulerOutput  # noqa: E402
from vllm.v1.worker.ec_connector_model_runner_mixin import (  # noqa: E402
    ECConnectorModelRunnerMixin as Runner,
)

from epd_vllm_ec.connector import EPDStoreECConnector  # noqa: E402
from epd_vllm_ec.settings import ConnectorConfigError  # noqa: E402
from gpu_workers.entries import fetch_outputs, store_outputs  # noqa: E402
from runtime.stores import open_store  # noqa: E402
from schemas.families import DEEPSTACK, EMBEDS, family  # noqa: E402
from schemas.signing import make_ec_transfer  # noqa: E402

MODULE = "epd_vllm_ec.connector"
NAME = "EPDStoreECConnector"
SECRET = "s3cret-for-the-vllm-interface"
FP = "qwen-tiny-fp"
REDIS_BASE = "redis://127.0.0.1:6379/14"


@dataclass
class SmallestVllmConfig:
    """The fields of ``VllmConfig`` the connector (and vLLM's connector base) read."""

    ec_transfer_config: ECTransferConfig
    model_config: Any = field(
        default_factory=lambda: SimpleNamespace(dtype=torch.float16, hf_config=None)
    )


@dataclass
class Req:
    """The fields of ``vllm.v1.request.Request`` the connector reads."""

    request_id: str
    mm_features: list[MultiModalFeatureSpec]
    ec_transfer_params: dict[str, Any] | None = None

    def get_num_encoder_embeds(self, input_id: int) -> int:
        return self.mm_features[input_id].mm_position.get_num_embeds()


def feature(mm_hash: str, tokens: int, data: Any = None) -> MultiModalFeatureSpec:
    """An image item: ``data`` None is a metadata-only item (its embedding must come in)."""
    return MultiModalFeatureSpec(
        data=data, modality="image", identifier=mm_hash, mm_position=PlaceholderRange(3, tokens)
    )


def config(role: str, store_url: str, **extra: Any) -> SmallestVllmConfig:
    return SmallestVllmConfig(
        ECTransferConfig(
            ec_connector=NAME,
            ec_connector_module_path=MODULE,
            ec_role=role,  # type: ignore[arg-type]
            ec_connector_extra_config={"store_url": store_url, "model_fingerprint": FP, **extra},
        )
    )


def scheduler(cfg: SmallestVllmConfig) -> ECConnectorBase:
    return ECConnectorFactory.create_connector(cfg, ECConnectorRole.SCHEDULER)  # type: ignore[arg-type]


def step(meta: Any) -> SchedulerOutput:
    out = SchedulerOutput.make_empty()
    out.ec_connector_metadata = meta
    return out


@pytest.fixture(params=["redis", "cluster"])
def store_url(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    monkeypatch.setenv("EPD_EC_SECRET", SECRET)
    tag = uuid.uuid4().hex[:12]
    cluster = request.getfixturevalue("redis_cluster") if request.param == "cluster" else None
    base = cluster.url if cluster is not None else REDIS_BASE
    yield f"{base}?key_prefix=test-{tag}:"
    if cluster is not None:
        cluster.delete(f"test-{tag}:*")
    else:
        asyncio.run(_drop_keys(f"test-{tag}:*"))


async def _drop_keys(pattern: str) -> None:
    client = aioredis.Redis.from_url(REDIS_BASE)
    keys = [k async for k in client.scan_iter(match=pattern)]
    if keys:
        await client.delete(*keys)
    await client.aclose()


@pytest.fixture
def connectors() -> Iterator[list[ECConnectorBase]]:
    """Scheduler-side connectors made in a test, shut down after it (so is the worker's)."""
    made: list[ECConnectorBase] = []
    yield made
    for c in made:
        c.shutdown()
    ec_transfer_state.ensure_ec_transfer_shutdown()


def test_vllm_loads_the_connector_by_module_path() -> None:
    cfg = ECTransferConfig(ec_connector=NAME, ec_connector_module_path=MODULE, ec_role="ec_both")
    cls = ECConnectorFactory.get_connector_class(cfg)
    assert cls is EPDStoreECConnector and issubclass(cls, ECConnectorBase)


def test_bad_extra_config_fails_at_creation_naming_the_key(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("EPD_EC_SECRET", raising=False)
    with pytest.raises(ConnectorConfigError, match="set EPD_EC_SECRET"):
        scheduler(config("ec_consumer", f"{REDIS_BASE}?key_prefix=t:"))
    monkeypatch.setenv("EPD_EC_SECRET", SECRET)
    with pytest.raises(ConnectorConfigError, match="another process can read"):
        scheduler(config("ec_consumer", "local://x"))


def produce(cfg: SmallestVllmConfig, req: Req, outputs: dict[str, torch.Tensor]) -> Any:
    """An encoder instance's step for ``req``, as vLLM runs it; its ``ec_transfer_params``."""
    sched = scheduler(cfg)
    try:
        for i, f in enumerate(req.mm_features):
            assert not sched.has_cache_item(f.identifier)  # not stored yet: vLLM encodes it
            sched.update_state_after_alloc(req, i)
        meta = sched.build_connector_meta(step(None))
        ec_transfer_state.ensure_ec_transfer_initialized(cfg)  # type: ignore[arg-type]
        encoder_cache: dict[str, torch.Tensor] = {}
        with Runner.maybe_get_ec_connector_output(step(meta), encoder_cache) as out:
            for mm_hash, tensor in outputs.items():  # the model runner's _cache_encoder_output
                encoder_cache[mm_hash] = tensor
                Runner.maybe_save_ec_to_connector(encoder_cache, mm_hash)
        assert (out.finished_sending, out.finished_recving) == (None, None)
        ec_transfer_state.ensure_ec_transfer_shutdown()
        # A second request for the same item is a hit: vLLM does not encode it again.
        assert all(sched.has_cache_item(h) for h in outputs)
        delay_free, params = sched.request_finished(req)
        assert delay_free is False
        return params
    finally:
        sched.shutdown()


def consume(cfg: SmallestVllmConfig, req: Req, sched: ECConnectorBase) -> dict[str, torch.Tensor]:
    """A prefill instance's scheduling step and model-runner step for ``req``."""
    assert sched.ensure_cache_available(req, 0)
    for i, f in enumerate(req.mm_features):
        assert sched.has_cache_item(f.identifier), f.identifier
        sched.update_state_after_alloc(req, i)
    meta = sched.build_connector_meta(step(None))
    ec_transfer_state.ensure_ec_transfer_initialized(cfg)  # type: ignore[arg-type]
    encoder_cache: dict[str, torch.Tensor] = {}
    with Runner.maybe_get_ec_connector_output(step(meta), encoder_cache):
        pass  # vLLM's _execute_mm_encoder / _gather_mm_embeddings read the cache here
    ec_transfer_state.ensure_ec_transfer_shutdown()
    return encoder_cache


async def test_a_producers_items_reach_a_consumer_and_ours_do_too(
    store_url: str, connectors: list[ECConnectorBase]
) -> None:
    vllm_out = torch.randn(4, 16)
    produced = produce(
        config("ec_producer", store_url),
        Req("enc-1", [feature("img-v", 4, data=b"px")]),
        {"img-v": vllm_out},
    )
    assert set(produced) == {"img-v"} and produced["img-v"]["signature"]
    # An item our encode worker stored, with the entry `epd vllm split` signs for it.
    ours = torch.randn(6, 16).to(torch.bfloat16)
    async with open_store(store_url) as store:
        key = f"ec:{FP}:our-content-hash"
        await store_outputs(store, key, {EMBEDS: ours}, family("qwen2_vl"), 60)
        url = store.url
    ec = make_ec_transfer(
        mm_hash="img-o", store=url, key=key, expires_ms=_now_ms() + 60_000, secret=SECRET.encode()
    )
    params = {**produced, "img-o": {"mm_hash": "img-o", **_fields(ec)}}
    cfg = config("ec_consumer", store_url)
    sched = scheduler(cfg)
    connectors.append(sched)
    req = Req("pre-1", [feature("img-v", 4), feature("img-o", 6)], params)
    cache = consume(cfg, req, sched)
    # vLLM's model dtype (float16), vLLM's shape.
    assert cache["img-v"].dtype == torch.float16 and torch.equal(cache["img-v"], vllm_out.half())
    assert torch.equal(cache["img-o"], ours.half())
    assert sched.request_finished(req) == (False, None)
    assert not sched.has_cache_item("img-v")  # trusted for the requests that carried it only


async def test_a_qwen3_vl_producers_save_is_read_by_our_prefill_path(
    store_url: str, connectors: list[ECConnectorBase]
) -> None:
    cfg = config("ec_producer", store_url)
    cfg.model_config = SimpleNamespace(
        dtype=torch.bfloat16,
        hf_config=SimpleNamespace(vision_config=SimpleNamespace(deepstack_visual_indexes=[5, 11])),
    )
    embeds, deepstack = torch.randn(3, 8), torch.randn(2, 3, 8)
    params = produce(
        cfg,
        Req("enc-2", [feature("img-3", 3, data=b"px")]),
        {"img-3": torch.cat([embeds, *deepstack], dim=1)},
    )
    async with open_store(store_url) as store:
        [entry] = await fetch_outputs(store, [params["img-3"]["key"]], family("qwen3_vl"))
    assert torch.equal(entry[EMBEDS], embeds) and torch.equal(entry[DEEPSTACK], deepstack)


def test_forged_foreign_and_wrong_model_entries_are_refused(
    store_url: str, connectors: list[ECConnectorBase], caplog: pytest.LogCaptureFixture
) -> None:
    good = produce(
        config("ec_producer", store_url),
        Req("enc-3", [feature("img", 2, data=b"px")]),
        {"img": torch.ones(2, 4)},
    )["img"]
    other_model = produce(
        config("ec_producer", store_url, model_fingerprint="other-model"),
        Req("enc-4", [feature("img", 2, data=b"px")]),
        {"img": torch.ones(2, 4)},
    )["img"]
    sched = scheduler(config("ec_consumer", store_url))
    connectors.append(sched)
    elsewhere = f"elsewhere-{uuid.uuid4().hex[:8]}:"
    foreign = produce(
        config("ec_producer", f"{REDIS_BASE}?key_prefix={elsewhere}"),
        Req("enc-5", [feature("img", 2, data=b"px")]),
        {"img": torch.ones(2, 4)},
    )["img"]
    asyncio.run(_drop_keys(f"{elsewhere}*"))
    cases = {
        "forged": ({**good, "signature": "0" * 64}, "ec-signature"),
        "foreign": (foreign, "ec-store"),
        "wrong-model": (other_model, "ec-key"),
    }
    caplog.set_level(logging.WARNING, logger="epd_vllm_ec")
    for name, (entry, rule) in cases.items():
        # Metadata only: nothing to encode it from, so vLLM fails the request.
        bare = Req(f"{name}-bare", [feature("img", 2)], {"img": entry})
        assert not sched.ensure_cache_available(bare, 0)
        assert not sched.has_cache_item("img")
        assert sched.take_unavailable_requests() == {bare.request_id}
        # With its media: vLLM encodes it locally; nothing is planned to load.
        with_media = Req(f"{name}-media", [feature("img", 2, data=b"px")], {"img": entry})
        assert sched.ensure_cache_available(with_media, 0)
        assert not sched.has_cache_item("img")
        sched.update_state_after_alloc(with_media, 0)
        assert sched.build_connector_meta(step(None)).loads == []  # type: ignore[attr-defined]
        assert f"EC entry refused ({rule}) for request {bare.request_id}" in caplog.text
    # The genuine entry is trusted by the same consumer.
    assert sched.ensure_cache_available(Req("ok", [feature("img", 2)], {"img": good}), 0)
    assert sched.has_cache_item("img")


def _now_ms() -> int:
    return int(time.time() * 1000)


def _fields(ec: Any) -> dict[str, Any]:
    return {f: getattr(ec, f) for f in ("store", "key", "expires_ms", "signature")}
