"""Python client of the HTTP API (httpx): ``EPDClient`` (async) and ``SyncEPDClient``.

Both speak the same routes with the same typed results; server errors become typed exceptions
carrying the server's ``code`` and ``rule``; 429 and 503 are retried, honouring ``Retry-After``
with jitter (:class:`RetryPolicy`).
"""

from __future__ import annotations

import asyncio
import base64
import json
import math
import random
import time
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

TERMINAL = frozenset({"completed", "failed", "rejected", "expired", "cancelled"})
ImageArg = bytes | bytearray | memoryview | Path

# ----------------------------------------------------------------------------- results


@dataclass(slots=True)
class StageTiming:
    started: str | None = None
    finished: str | None = None
    ms: float | None = None


@dataclass(slots=True)
class Item:
    modality: str
    mm_hash: str
    cache_hit: bool | None
    encoded: bool


@dataclass(slots=True)
class Result:
    token_ids: list[int]
    text: str | None = None


@dataclass(slots=True)
class ErrorDetail:
    code: str
    message: str
    rule: str | None = None
    modality: str | None = None
    item: int | None = None
    field: str | None = None


@dataclass(slots=True)
class RequestStatus:
    """``GET /v1/requests/{id}``."""

    request_id: str
    status: str
    created_at: str
    stages: dict[str, StageTiming]
    items: list[Item]
    result: Result | None = None
    error: ErrorDetail | None = None
    metadata: dict[str, str] | None = None
    updated_at: str | None = None
    raw: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def done(self) -> bool:
        return self.status in TERMINAL

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> RequestStatus:
        err = obj.get("error")
        res = obj.get("result")
        return cls(
            request_id=obj["request_id"],
            status=obj["status"],
            created_at=obj["created_at"],
            updated_at=obj.get("updated_at"),
            stages={k: StageTiming(**v) for k, v in (obj.get("stages") or {}).items()},
            items=[Item(**it) for it in obj.get("items") or []],
            result=Result(**res) if res else None,
            error=ErrorDetail(**err) if err else None,
            metadata=obj.get("metadata"),
            raw=dict(obj),
        )


@dataclass(slots=True)
class StatusEvent:
    """One ``status`` Server-Sent Event of ``/events``."""

    id: str
    status: str
    stage: str
    data: dict[str, Any]


@dataclass(slots=True)
class TokenEvent:
    """One ``token`` Server-Sent Event of ``/events``: tokens as they were made, and their text
    (never half a character)."""

    id: str
    token_ids: list[int]
    text: str
    tokens_total: int
    finish_reason: str | None = None


# ------------------------------------------------------------------------------ errors


class EPDError(Exception):
    """An error answer of the API: HTTP status, the server's code, rule and location."""

    def __init__(self, status: int, body: Mapping[str, Any] | None, text: str = "") -> None:
        err = (body or {}).get("error") or {}
        self.status = status
        self.code: str = err.get("code", "http_error")
        self.message: str = err.get("message", text or f"HTTP {status}")
        self.rule: str | None = err.get("rule")
        self.field: str | None = err.get("field")
        self.item: int | None = err.get("item")
        self.modality: str | None = err.get("modality")
        where = f" ({self.rule})" if self.rule else ""
        super().__init__(f"{status} {self.code}{where}: {self.message}")


class BadRequest(EPDError):
    """400."""


class Unauthorized(EPDError):
    """401."""


class NotFound(EPDError):
    """404: unknown id (or another tenant's)."""


class Conflict(EPDError):
    """409: Idempotency-Key reused with another body, or cancel of a finished request."""


class TooLarge(EPDError):
    """413."""


class UnsupportedMediaType(EPDError):
    """415."""


class Rejected(EPDError):
    """422: a validation rule failed (``rule`` names it)."""


class Throttled(EPDError):
    """429, after the client's retries ran out."""


class Unavailable(EPDError):
    """503, after the client's retries ran out."""


_ERRORS: dict[int, type[EPDError]] = {
    400: BadRequest,
    401: Unauthorized,
    404: NotFound,
    409: Conflict,
    413: TooLarge,
    415: UnsupportedMediaType,
    422: Rejected,
    429: Throttled,
    503: Unavailable,
}


def _raise_for(resp: httpx.Response) -> None:
    if resp.status_code < 400:
        return
    try:
        body = resp.json()
    except ValueError:
        body = None
    raise _ERRORS.get(resp.status_code, EPDError)(resp.status_code, body, resp.text[:500])


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """When a call is tried again, and after how long: one loop for both clients, no
    recursion however many tries.

    429 and 503 are retried after the server's ``Retry-After`` (a number of seconds, at most
    ``max_delay_s``), or else an exponential backoff from ``base_s``; either way stretched by a
    random factor in ``[1, 1 + jitter]``, so clients throttled together do not come back
    together. A broken connection is retried the same way when the call is safe to repeat (a
    GET or DELETE, or a POST under an ``Idempotency-Key``).
    """

    retries: int = 5
    base_s: float = 0.25
    max_delay_s: float = 30.0
    jitter: float = 0.5

    def delay(self, attempt: int, retry_after: str | None, rng: random.Random) -> float:
        """Seconds to wait before try ``attempt + 1`` (``attempt`` counts from 0)."""
        backoff = min(self.base_s * 2 ** min(attempt, 32), self.max_delay_s)
        try:
            given = float(retry_after) if retry_after else None
        except ValueError:
            given = None  # an HTTP date or garbage: back off on our own
        wait = backoff if given is None or not math.isfinite(given) else given
        wait = min(max(wait, 0.0), self.max_delay_s)
        return wait * (1.0 + self.jitter * rng.random())

    def retryable(self, resp: httpx.Response | None, method: str, idempotent: bool) -> bool:
        """Whether an answer (``resp``) or a broken connection (None) is worth another try."""
        if resp is not None:
            return resp.status_code in (429, 503)
        return method in ("GET", "DELETE", "HEAD") or idempotent


RETRYABLE_TRANSPORT = (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError)
"""Connection failures where the server may not have seen the call (or a repeat is safe)."""


# ----------------------------------------------------------------------------- requests


def _status_params(wait_s: float, changed_from: str | None) -> dict[str, Any] | None:
    """Query of a status read: a long-poll when ``wait_s`` > 0, from ``changed_from`` if given."""
    if wait_s <= 0:
        return None
    params: dict[str, Any] = {"wait": wait_s}
    if changed_from is not None:
        params["changed_from"] = changed_from
    return params


def _image_bytes(img: ImageArg) -> bytes:
    # Paths are read here, on the client's machine; the server takes bytes only.
    return img.read_bytes() if isinstance(img, Path) else bytes(img)


def _submit_parts(
    prompt: str | None,
    token_ids: Sequence[int] | None,
    images: Sequence[ImageArg],
    max_tokens: int,
    cache_salt: str | None,
    deadline_s: float | None,
    metadata: Mapping[str, str] | None,
    ignore_eos: bool = False,
    sampling: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """httpx keyword arguments of a submission: multipart with the image files (no base64
    inflation), or JSON when there is no image. ``sampling``: the sampling fields given
    (temperature, top_p, top_k, seed, stop)."""
    chosen = {k: v for k, v in (sampling or {}).items() if v is not None}
    fields: dict[str, Any] = {"max_tokens": str(max_tokens)}
    for k, v in chosen.items():
        fields[k] = [str(x) for x in v] if isinstance(v, list | tuple) else str(v)
    if ignore_eos:
        fields["ignore_eos"] = "true"
    if prompt is not None:
        fields["prompt"] = prompt
    if token_ids is not None:
        fields["token_ids"] = json.dumps(list(token_ids))
    if cache_salt is not None:
        fields["cache_salt"] = cache_salt
    if deadline_s is not None:
        fields["deadline_s"] = str(deadline_s)
    if metadata is not None:
        fields["metadata"] = json.dumps(dict(metadata))
    if not images:
        body: dict[str, Any] = {"max_tokens": max_tokens, "ignore_eos": ignore_eos}
        for k in ("prompt", "cache_salt"):
            if k in fields:
                body[k] = fields[k]
        if token_ids is not None:
            body["token_ids"] = list(token_ids)
        if deadline_s is not None:
            body["deadline_s"] = deadline_s
        if metadata is not None:
            body["metadata"] = dict(metadata)
        body.update({k: list(v) if isinstance(v, tuple) else v for k, v in chosen.items()})
        return {"json": body}
    files = [("images", (f"image{i}", _image_bytes(img))) for i, img in enumerate(images)]
    return {"data": fields, "files": files}


def _sampling(
    temperature: float | None,
    top_p: float | None,
    top_k: int | None,
    seed: int | None,
    stop: Sequence[str] | None,
) -> dict[str, Any]:
    return {
        "temperature": temperature,
        "top_p": top_p,
        "top_k": top_k,
        "seed": seed,
        "stop": list(stop) if stop else None,
    }


def image_to_data_url(data: bytes, mime: str = "image/png") -> str:
    """A ``data:`` URL for JSON submissions."""
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def _headers(token: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"} if token else {}


def _parse_sse(lines: list[str]) -> StatusEvent | TokenEvent | None:
    """One event of ``/events``; an ``error`` event raises its :class:`EPDError` (404, rule
    ``status-gone``: the request's record went before the request ended)."""
    ev_id, kind, data = "", "status", []
    for line in lines:
        if line.startswith("id:"):
            ev_id = line[3:].strip()
        elif line.startswith("event:"):
            kind = line[6:].strip()
        elif line.startswith("data:"):
            data.append(line[5:].lstrip())
    if not data:
        return None
    obj = json.loads("\n".join(data))
    if kind == "error":
        status = int(obj.get("status") or 500)
        raise _ERRORS.get(status, EPDError)(status, obj)
    if kind == "token":
        return TokenEvent(
            id=ev_id,
            token_ids=list(obj.get("token_ids") or []),
            text=str(obj.get("text") or ""),
            tokens_total=int(obj.get("tokens_total") or 0),
            finish_reason=obj.get("finish_reason"),
        )
    return StatusEvent(id=ev_id, status=obj.get("status", ""), stage=obj.get("stage", ""), data=obj)


def _wanted(ev: StatusEvent | TokenEvent | None, tokens: bool) -> bool:
    return ev is not None and (tokens or isinstance(ev, StatusEvent))


class EPDClient:
    """Async client. ``async with EPDClient(url) as c: rid = await c.submit(...)``."""

    def __init__(
        self,
        base_url: str = "http://127.0.0.1:8000",
        *,
        token: str | None = None,
        timeout_s: float = 30.0,
        retries: int = 5,
        transport: httpx.AsyncBaseTransport | None = None,
        retry: RetryPolicy | None = None,
    ) -> None:
        self.retry = retry or RetryPolicy(retries=retries)
        self._rng = random.Random()
        self._http = httpx.AsyncClient(
            base_url=base_url.rstrip("/"),
            headers=_headers(token),
            timeout=timeout_s,
            transport=transport,
        )

    async def __aenter__(self) -> EPDClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    async def _request(self, method: str, url: str, **kw: Any) -> httpx.Response:
        idempotent = "Idempotency-Key" in (kw.get("headers") or {})
        attempt = 0
        while True:
            try:
                resp: httpx.Response | None = await self._http.request(method, url, **kw)
            except RETRYABLE_TRANSPORT:
                if attempt >= self.retry.retries or not self.retry.retryable(
                    None, method, idempotent
                ):
                    raise
                resp = None
            if resp is not None and (
                attempt >= self.retry.retries or not self.retry.retryable(resp, method, idempotent)
            ):
                _raise_for(resp)
                return resp
            after = resp.headers.get("retry-after") if resp is not None else None
            await asyncio.sleep(self.retry.delay(attempt, after, self._rng))
            attempt += 1

    async def submit(
        self,
        *,
        prompt: str | None = None,
        token_ids: Sequence[int] | None = None,
        images: Sequence[ImageArg] = (),
        max_tokens: int = 16,
        cache_salt: str | None = None,
        deadline_s: float | None = None,
        metadata: Mapping[str, str] | None = None,
        idempotency_key: str | None = None,
        ignore_eos: bool = False,
        temperature: float | None = None,
        top_p: float | None = None,
        top_k: int | None = None,
        seed: int | None = None,
        stop: Sequence[str] | None = None,
    ) -> str:
        """Submit a request; returns its id (202, or 200 for a repeated Idempotency-Key).
        ``temperature`` 0 (the server's default) is greedy; above it the tokens are sampled
        (``top_p``, ``top_k``, ``seed``: the same seed gives the same tokens); ``stop``
        strings end generation."""
        sampling = _sampling(temperature, top_p, top_k, seed, stop)
        kw = _submit_parts(
            prompt,
            token_ids,
            images,
            max_tokens,
            cache_salt,
            deadline_s,
            metadata,
            ignore_eos,
            sampling,
        )
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else {}
        resp = await self._request("POST", "/v1/requests", headers=headers, **kw)
        return str(resp.json()["request_id"])

    async def submit_vllm(
        self, generate_request: Mapping[str, Any], *, idempotency_key: str | None = None
    ) -> str:
        """Fan out a vLLM render response / GenerateRequest JSON; returns the request id."""
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else {}
        resp = await self._request(
            "POST", "/v1/vllm/generate", json=dict(generate_request), headers=headers
        )
        return str(resp.json()["request_id"])

    async def status(
        self, request_id: str, *, wait_s: float = 0.0, changed_from: str | None = None
    ) -> RequestStatus:
        """The request's status; ``wait_s`` long-polls until it changes (from
        ``changed_from``, the last status you saw, when given: then no change is missed)."""
        params = _status_params(wait_s, changed_from)
        timeout = httpx.Timeout((self._http.timeout.read or 30.0) + wait_s + 10)
        resp = await self._request(
            "GET", f"/v1/requests/{request_id}", params=params, timeout=timeout
        )
        return RequestStatus.from_json(resp.json())

    async def wait(self, request_id: str, timeout_s: float = 300.0) -> RequestStatus:
        """Long-poll until the request is terminal; TimeoutError after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        seen: str | None = None
        while True:
            left = deadline - time.monotonic()
            st = await self.status(request_id, wait_s=max(0.0, min(left, 30.0)), changed_from=seen)
            seen = st.status
            if st.done:
                return st
            if time.monotonic() >= deadline:
                raise TimeoutError(f"request {request_id} still {st.status} after {timeout_s}s")

    async def events(
        self, request_id: str, *, last_event_id: str | None = None, tokens: bool = False
    ) -> AsyncIterator[Any]:
        """Every status change as it happens (SSE: :class:`StatusEvent`); ends after the
        terminal one (raises :class:`NotFound`, rule ``status-gone``, if the request's record
        went first). ``tokens``: the :class:`TokenEvent` s too, as the request decodes.
        Resume with ``last_event_id`` (the ``id`` of the last event seen, of either kind)."""
        headers = {"Last-Event-ID": last_event_id} if last_event_id else {}
        async with self._http.stream(
            "GET",
            f"/v1/requests/{request_id}/events",
            headers=headers,
            timeout=httpx.Timeout(10.0, read=None),
        ) as resp:
            if resp.status_code >= 400:
                await resp.aread()
                _raise_for(resp)
            lines: list[str] = []
            async for line in resp.aiter_lines():
                if line:
                    lines.append(line)
                    continue
                ev = _parse_sse(lines)
                lines = []
                if _wanted(ev, tokens):
                    yield ev

    async def cancel(self, request_id: str) -> RequestStatus:
        """Cancel; the answer's status is ``cancelled`` (Conflict if it already finished)."""
        resp = await self._request("DELETE", f"/v1/requests/{request_id}")
        return RequestStatus.from_json(resp.json())


class SyncEPDClient:
    """The same client for synchronous code (``httpx.Client``)."""

    def __init__(
        self,
        base_url: str = "http://127.0.0.1:8000",
        *,
        token: str | None = None,
        timeout_s: float = 30.0,
        retries: int = 5,
        retry: RetryPolicy | None = None,
    ) -> None:
        self.retry = retry or RetryPolicy(retries=retries)
        self._rng = random.Random()
        self._http = httpx.Client(
            base_url=base_url.rstrip("/"), headers=_headers(token), timeout=timeout_s
        )

    def __enter__(self) -> SyncEPDClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def _request(self, method: str, url: str, **kw: Any) -> httpx.Response:
        idempotent = "Idempotency-Key" in (kw.get("headers") or {})
        attempt = 0
        while True:
            try:
                resp: httpx.Response | None = self._http.request(method, url, **kw)
            except RETRYABLE_TRANSPORT:
                if attempt >= self.retry.retries or not self.retry.retryable(
                    None, method, idempotent
                ):
                    raise
                resp = None
            if resp is not None and (
                attempt >= self.retry.retries or not self.retry.retryable(resp, method, idempotent)
            ):
                _raise_for(resp)
                return resp
            after = resp.headers.get("retry-after") if resp is not None else None
            time.sleep(self.retry.delay(attempt, after, self._rng))
            attempt += 1

    def submit(
        self,
        *,
        prompt: str | None = None,
        token_ids: Sequence[int] | None = None,
        images: Sequence[ImageArg] = (),
        max_tokens: int = 16,
        cache_salt: str | None = None,
        deadline_s: float | None = None,
        metadata: Mapping[str, str] | None = None,
        idempotency_key: str | None = None,
        ignore_eos: bool = False,
        temperature: float | None = None,
        top_p: float | None = None,
        top_k: int | None = None,
        seed: int | None = None,
        stop: Sequence[str] | None = None,
    ) -> str:
        """See :meth:`EPDClient.submit`."""
        sampling = _sampling(temperature, top_p, top_k, seed, stop)
        kw = _submit_parts(
            prompt,
            token_ids,
            images,
            max_tokens,
            cache_salt,
            deadline_s,
            metadata,
            ignore_eos,
            sampling,
        )
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else {}
        return str(
            self._request("POST", "/v1/requests", headers=headers, **kw).json()["request_id"]
        )

    def submit_vllm(
        self, generate_request: Mapping[str, Any], *, idempotency_key: str | None = None
    ) -> str:
        """See :meth:`EPDClient.submit_vllm`."""
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else {}
        resp = self._request(
            "POST", "/v1/vllm/generate", json=dict(generate_request), headers=headers
        )
        return str(resp.json()["request_id"])

    def status(
        self, request_id: str, *, wait_s: float = 0.0, changed_from: str | None = None
    ) -> RequestStatus:
        """See :meth:`EPDClient.status`."""
        params = _status_params(wait_s, changed_from)
        resp = self._request(
            "GET",
            f"/v1/requests/{request_id}",
            params=params,
            timeout=httpx.Timeout(30.0 + wait_s + 10),
        )
        return RequestStatus.from_json(resp.json())

    def wait(self, request_id: str, timeout_s: float = 300.0) -> RequestStatus:
        """See :meth:`EPDClient.wait`."""
        deadline = time.monotonic() + timeout_s
        seen: str | None = None
        while True:
            left = deadline - time.monotonic()
            st = self.status(request_id, wait_s=max(0.0, min(left, 30.0)), changed_from=seen)
            seen = st.status
            if st.done:
                return st
            if time.monotonic() >= deadline:
                raise TimeoutError(f"request {request_id} still {st.status} after {timeout_s}s")

    def events(
        self, request_id: str, *, last_event_id: str | None = None, tokens: bool = False
    ) -> Iterator[Any]:
        """See :meth:`EPDClient.events`."""
        headers = {"Last-Event-ID": last_event_id} if last_event_id else {}
        with self._http.stream(
            "GET",
            f"/v1/requests/{request_id}/events",
            headers=headers,
            timeout=httpx.Timeout(10.0, read=None),
        ) as resp:
            if resp.status_code >= 400:
                resp.read()
                _raise_for(resp)
            lines: list[str] = []
            for line in resp.iter_lines():
                if line:
                    lines.append(line)
                    continue
                ev = _parse_sse(lines)
                lines = []
                if _wanted(ev, tokens):
                    yield ev

    def cancel(self, request_id: str) -> RequestStatus:
        """See :meth:`EPDClient.cancel`."""
        return RequestStatus.from_json(self._request("DELETE", f"/v1/requests/{request_id}").json())
