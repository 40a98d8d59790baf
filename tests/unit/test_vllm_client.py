"""The vLLM HTTP client against the stand-in built from vLLM 0.33.0's code (no live vLLM): a
streamed reply, vLLM's 400, a 500 and a dropped connection, and an abort the server records."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from tests.vllm_side import use_vllm

use_vllm()

from gpu_workers.instant import INSTANT_TEXT  # noqa: E402
from gpu_workers.vllm_engine.client import VllmClient, pick  # noqa: E402
from schemas.vllm_generate import REJECTED_RULE, VllmRejected, VllmUnavailable  # noqa: E402
from tests.vllm_standin import StandIn  # noqa: E402

BODY = {
    "request_id": "r1",
    "token_ids": [1, 2, 3],
    "sampling_params": {"max_tokens": 5, "temperature": 0.0, "stop": [], "stop_token_ids": []},
    "stream": True,
}


@pytest.fixture(scope="module")
def standin() -> Iterator[StandIn]:
    with StandIn() as s:
        yield s


async def _all(client: VllmClient, body: dict) -> list:
    return [o async for o in client.generate(body)]


def test_streamed_tokens_and_errors(standin: StandIn) -> None:
    async def go() -> None:
        client = VllmClient([standin.url])
        outs = await _all(client, BODY)
        assert [t for o in outs for t in o.token_ids] == list(INSTANT_TEXT[:5])
        assert outs[-1].finish_reason == "length"
        with pytest.raises(VllmRejected) as err:
            await _all(client, {**BODY, "token_ids": []})
        assert err.value.rule == REJECTED_RULE and "token_ids" in str(err.value)
        standin.fail_next("500", "drop")
        with pytest.raises(VllmUnavailable, match="500"):
            await _all(client, BODY)
        with pytest.raises(VllmUnavailable, match="peer closed"):
            await _all(client, BODY)
        assert await client.abort("r1")
        await client.close()

    asyncio.run(go())
    assert "generate-tokens-r1" in standin.state.aborts


def test_request_ids_hash_to_one_instance() -> None:
    urls = ["http://a", "http://b", "http://c"]
    picked = {pick(urls, f"req-{i}") for i in range(60)}
    assert picked == set(urls)
    assert all(pick(urls, "req-7") == pick(urls, "req-7") for _ in range(3))


def test_an_encode_vllm_answered_is_not_encoded_until_its_entry_is_in_our_store(
    standin: StandIn, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The stand-in here has no store (its EC connector writes nowhere): vLLM's 200 is not
    enough, the encode fails (retryable) naming the missing entry."""
    import types

    import torch

    from gpu_workers.vllm_engine import encode as venc
    from runtime.model import load_model
    from runtime.settings import Settings
    from runtime.stores.local import LocalStore
    from schemas.signing import make_ec_transfer
    from schemas.types import EncodeEvent

    monkeypatch.setattr(venc, "ENTRY_WAIT_S", 0.3)
    ctx = types.SimpleNamespace(
        settings=Settings(engine="vllm", vllm_encode_url=standin.url),
        bundle=load_model("instant", device="cpu"),
        store=LocalStore(),
    )
    tensors = {"pixel_values": torch.randn(16, 1176), "image_grid_thw": torch.tensor([1, 4, 4])}
    ec = make_ec_transfer(
        mm_hash="h", store="local://", key="k", expires_ms=4 * 10**12, secret=None
    )
    ev = EncodeEvent("enc-r", "instant", "image", 0, "h", dict(tensors), ec)

    async def go() -> None:
        enc = venc.VllmEncoder(ctx)  # type: ignore[arg-type]
        try:
            with pytest.raises(VllmUnavailable, match="entry is not in the store"):
                await enc.encode(ev, tensors, "image_grid_thw")
        finally:
            await enc.close()

    asyncio.run(go())
    assert any(b["request_id"] == "enc-r-enc-image0" for b in standin.state.requests)
