"""An async HTTP client for vLLM's scale-out routes (``/inference/v1/generate``, abort).

The bodies and replies are :mod:`schemas.vllm_generate`'s; this module only moves them. A request
goes to one instance of a list, chosen by its request id (a stable hash, so a retry reaches the
instance that may still hold its prefix cache). Transport failures (refused, reset, a read past
``EPD_VLLM_TIMEOUT_S``, a stream cut before its finish) become
:class:`~schemas.vllm_generate.VllmUnavailable`, which the consume loop retries.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import AsyncGenerator
from typing import TYPE_CHECKING, Any

import httpx

from schemas.vllm_generate import (
    ABORT_PATH,
    GENERATE_PATH,
    VllmOutput,
    VllmUnavailable,
    abort_body,
    error_for,
    parse_event,
)

if TYPE_CHECKING:
    from runtime.settings import Settings

log = logging.getLogger(__name__)

ERROR_BODY_BYTES = 64 * 1024
"""What is read of an error reply (its message is cut far shorter in the dead letter)."""


async def _head(resp: httpx.Response) -> bytes:
    """The first ``ERROR_BODY_BYTES`` of a streamed reply's body (an error page of any size is
    never read whole)."""
    out = bytearray()
    async for chunk in resp.aiter_bytes():
        out += chunk[: ERROR_BODY_BYTES - len(out)]
        if len(out) >= ERROR_BODY_BYTES:
            break
    return bytes(out)


def pick(urls: list[str], request_id: str) -> str:
    """The instance of ``urls`` that ``request_id`` hashes to."""
    if not urls:
        raise ValueError("no vLLM instance configured")
    digest = hashlib.sha256(request_id.encode()).digest()
    return urls[int.from_bytes(digest[:8], "big") % len(urls)]


class VllmClient:
    """Streams generate requests to vLLM instances and asks them to abort."""

    def __init__(
        self,
        urls: list[str],
        *,
        timeout_s: float = 120.0,
        connect_timeout_s: float = 5.0,
        api_key: str | None = None,
    ) -> None:
        self.urls = list(urls)
        self.http = httpx.AsyncClient(
            timeout=httpx.Timeout(timeout_s, connect=connect_timeout_s),
            headers={"Authorization": f"Bearer {api_key}"} if api_key else None,
            # One connection per streamed request: a pool too small would queue requests
            # behind each other's streams.
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=64),
        )

    @classmethod
    def for_settings(cls, urls: list[str], settings: Settings) -> VllmClient:
        """A client on ``urls`` with ``EPD_VLLM_*``'s timeouts and key."""
        key = settings.vllm_api_key
        return cls(
            urls,
            timeout_s=settings.vllm_timeout_s,
            connect_timeout_s=settings.vllm_connect_timeout_s,
            api_key=key.get_secret_value() if key is not None else None,
        )

    async def close(self) -> None:
        await self.http.aclose()

    async def generate(self, body: dict[str, Any]) -> AsyncGenerator[VllmOutput, None]:
        """The streamed reply to ``body`` (``stream: true``), one delta at a time, ending with the
        delta that carries the finish reason. Raises ``VllmRejected`` (vLLM blames the body) or
        ``VllmUnavailable`` (a 5xx, a transport failure, a stream without its finish)."""
        url = pick(self.urls, str(body.get("request_id", ""))) + GENERATE_PATH
        finished = False
        try:
            async with self.http.stream("POST", url, json=body) as resp:
                if resp.status_code != 200:
                    raise error_for(resp.status_code, await _head(resp))
                async for line in resp.aiter_lines():
                    out = parse_event(line)
                    if out is None:
                        continue
                    finished = finished or out.finish_reason is not None
                    yield out
        except httpx.TransportError as exc:  # connect, read, a peer that hung up mid-stream
            raise VllmUnavailable(f"vLLM at {url}: {type(exc).__name__}: {exc}") from exc
        if not finished:
            raise VllmUnavailable(f"vLLM at {url} ended the stream without a finish reason")

    async def post_whole(self, body: dict[str, Any]) -> Any:
        """The whole (``stream: false``) reply to ``body`` as JSON; raises as :meth:`generate`."""
        url = pick(self.urls, str(body.get("request_id", ""))) + GENERATE_PATH
        try:
            resp = await self.http.post(url, json=body)
        except httpx.TransportError as exc:
            raise VllmUnavailable(f"vLLM at {url}: {type(exc).__name__}: {exc}") from exc
        if resp.status_code != 200:
            raise error_for(resp.status_code, resp.content)
        try:
            return resp.json()
        except ValueError:
            raise VllmUnavailable(f"vLLM at {url} answered 200 without JSON") from None

    async def abort(self, request_id: str) -> bool:
        """Ask the instance serving ``request_id`` to abort it; False when it could not be told
        (the stream's close aborts it too: vLLM aborts a request whose client went)."""
        url = pick(self.urls, request_id) + ABORT_PATH
        try:
            resp = await self.http.post(url, json=abort_body([request_id]))
        except httpx.HTTPError as exc:
            log.warning("vLLM abort of %s at %s failed: %s", request_id, url, exc)
            return False
        if resp.status_code != 200:
            log.warning("vLLM abort of %s at %s: %s", request_id, url, resp.status_code)
        return resp.status_code == 200
