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
