"""The vLLM client as settings build it (no vLLM needed: the client is plain httpx)."""

from __future__ import annotations

import httpx
import pytest
from pydantic import SecretStr

from gpu_workers.vllm_engine.client import ERROR_BODY_BYTES, VllmClient, _head
from runtime.settings import Settings


async def test_the_api_key_goes_as_a_bearer_token_and_timeouts_come_from_settings() -> None:
    s = Settings(vllm_api_key=SecretStr("k3y"), vllm_timeout_s=7.0, vllm_connect_timeout_s=2.0)
    client = VllmClient.for_settings(["http://vllm:8000"], s)
    try:
        assert client.http.headers["Authorization"] == "Bearer k3y"
        assert client.http.timeout.read == 7.0 and client.http.timeout.connect == 2.0
    finally:
        await client.close()
    bare = VllmClient.for_settings(["http://vllm:8000"], Settings())
    assert "Authorization" not in bare.http.headers
    await bare.close()
    assert "k3y" not in str(s.describe())


@pytest.mark.parametrize("size", [10, ERROR_BODY_BYTES * 3])
async def test_an_error_reply_is_read_only_up_to_its_bound(size: int) -> None:
    resp = httpx.Response(500, stream=httpx.ByteStream(b"x" * size))
    assert len(await _head(resp)) == min(size, ERROR_BODY_BYTES)
