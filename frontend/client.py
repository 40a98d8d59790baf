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
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, TypedDict, TypeVar, Unpack

import httpx

TERMINAL = frozenset({"completed", "failed", "rejected", "expired", "cancelled"})
ImageArg = bytes | bytearray | memoryview | Path
T = TypeVar("T")

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


def _status_params(
    wait_s: float, changed_from: str | None, until_done: bool = False
) -> dict[str, Any] | None:
    """Query of a status read: a long-poll when ``wait_s`` > 0, from ``changed_from`` if given,
    to the request's end with ``until_done``."""
    if wait_s <= 0:
        return None
    params: dict[str, Any] = {"wait": wait_s}
    if changed_from is not None:
        params["changed_from"] = changed_from
    if until_done:
        params["until_done"] = "true"
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


class SubmitArgs(TypedDict, total=False):
    """A request as :meth:`EPDClient.submit` takes it (for :meth:`EPDClient.run`)."""

    prompt: str | None
    token_ids: Sequence[int] | None
    images: Sequence[ImageArg]
    max_tokens: int
    cache_salt: str | None
    deadline_s: float | None
    metadata: Mapping[str, str] | None
    ignore_eos: bool
    temperature: float | None
    top_p: float | None
    top_k: int | None
    seed: int | None
    stop: Sequence[str] | None


def _parts_of(a: SubmitArgs) -> dict[str, Any]:
    """:func:`_submit_parts` of a request given as :class:`SubmitArgs` (submit's defaults)."""
    sampling = _sampling(
        a.get("temperature"), a.get("top_p"), a.get("top_k"), a.get("seed"), a.get("stop")
    )
    return _submit_parts(
        a.get("prompt"),
        a.get("token_ids"),
        a.get("images", ()),
        a.get("max_tokens", 16),
        a.get("cache_salt"),
        a.get("deadline_s"),
        a.get("metadata"),
        a.get("ignore_eos", False),
        sampling,
    )


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


class _SseReader:
    """Lines of ``/events`` in, the events wanted out (``tokens``: the token events too)."""

    def __init__(self, tokens: bool) -> None:
        self.tokens = tokens
        self._lines: list[str] = []

    def feed(self, line: str) -> StatusEvent | TokenEvent | None:
        """The event a blank ``line`` ends, when it is one wanted; None otherwise."""
        if line:
            self._lines.append(line)
            return None
        ev, self._lines = _parse_sse(self._lines), []
        return ev if isinstance(ev, StatusEvent) or (self.tokens and ev is not None) else None


# ---------------------------------------------------------------------- calls, sans I/O


@dataclass(frozen=True, slots=True)
class _Call(Generic[T]):
    """One API call as data: what to send and how to read its answer. Both clients send the
    same calls; only the sending (``await`` or not) is theirs."""

    method: str
    url: str
    kw: dict[str, Any]
    read: Callable[[Any], T]
    """The answer's JSON -> the method's result."""

    @property
    def idempotent(self) -> bool:
        return "Idempotency-Key" in (self.kw.get("headers") or {})

    def answer(self, resp: httpx.Response) -> T:
        """The result of a final answer (an error answer raises its :class:`EPDError`)."""
        _raise_for(resp)
        return self.read(resp.json())


def _request_id(body: Any) -> str:
    return str(body["request_id"])


def _keyed(idempotency_key: str | None) -> dict[str, str]:
    return {"Idempotency-Key": idempotency_key} if idempotency_key else {}


def _submit_call(parts: dict[str, Any], idempotency_key: str | None) -> _Call[str]:
    return _Call("POST", "/v1/requests", {**parts, "headers": _keyed(idempotency_key)}, _request_id)


def _status_or_id(body: Any) -> RequestStatus | str:
    """A submit's answer: the request's status (it waited) or, accepted only, its id."""
    return RequestStatus.from_json(body) if "created_at" in body else _request_id(body)


def _run_call(
    parts: dict[str, Any], idempotency_key: str | None, wait_s: float, read_s: float | None
) -> _Call[RequestStatus | str]:
    """A submission that holds the answer up to ``wait_s`` until the request has finished."""
    timeout = httpx.Timeout((read_s or 30.0) + wait_s + 10)
    kw = {
        **parts,
        "headers": _keyed(idempotency_key),
        "params": {"wait": f"{wait_s:.3f}"},
        "timeout": timeout,
    }
    return _Call("POST", "/v1/requests", kw, _status_or_id)


def _submit_vllm_call(
    generate_request: Mapping[str, Any], idempotency_key: str | None
) -> _Call[str]:
    kw = {"json": dict(generate_request), "headers": _keyed(idempotency_key)}
    return _Call("POST", "/v1/vllm/generate", kw, _request_id)


def _status_call(
    request_id: str,
    wait_s: float,
    changed_from: str | None,
    read_s: float | None,
    until_done: bool = False,
) -> _Call[RequestStatus]:
    # A long-poll answers after up to wait_s: the read timeout stretches by as much.
    timeout = httpx.Timeout((read_s or 30.0) + wait_s + 10)
    kw = {"params": _status_params(wait_s, changed_from, until_done), "timeout": timeout}
    return _Call("GET", f"/v1/requests/{request_id}", kw, RequestStatus.from_json)


def _cancel_call(request_id: str) -> _Call[RequestStatus]:
    return _Call("DELETE", f"/v1/requests/{request_id}", {}, RequestStatus.from_json)


def _events_stream(request_id: str, last_event_id: str | None) -> dict[str, Any]:
    """``httpx`` stream arguments of ``/events`` (no read timeout: a stream may idle)."""
    return {
        "method": "GET",
        "url": f"/v1/requests/{request_id}/events",
        "headers": {"Last-Event-ID": last_event_id} if last_event_id else {},
        "timeout": httpx.Timeout(10.0, read=None),
    }


class _Tries:
    """The retry decisions of one call, apart from its I/O."""

    def __init__(self, policy: RetryPolicy, rng: random.Random, call: _Call[Any]) -> None:
        self.policy, self.rng, self.call = policy, rng, call
        self.attempt = 0

    def wait_s(self, resp: httpx.Response | None) -> float | None:
        """Seconds to wait before another try after ``resp`` (None: the connection broke), or
        None when it is final."""
        call, policy = self.call, self.policy
        if self.attempt >= policy.retries or not policy.retryable(
            resp, call.method, call.idempotent
        ):
            return None
        after = resp.headers.get("retry-after") if resp is not None else None
        wait = policy.delay(self.attempt, after, self.rng)
        self.attempt += 1
        return wait


class _Wait:
    """The long-poll loop of ``wait``, apart from its I/O: each status read waits for a change
    from the last status seen, at most 30 s and never past the caller's timeout."""

    def __init__(self, request_id: str, timeout_s: float) -> None:
        self.request_id, self.timeout_s = request_id, timeout_s
        self.deadline = time.monotonic() + timeout_s
        self.seen: str | None = None

    def poll_s(self, most_s: float = 30.0) -> float:
        return min(self.left_s(), most_s)

    def left_s(self) -> float:
        """Seconds left before the caller's timeout (0 once it has passed)."""
        return max(0.0, self.deadline - time.monotonic())

    def first(self, answer: RequestStatus | str) -> RequestStatus | None:
        """The end of a run whose submit answered ``answer`` (None: wait on for it)."""
        if isinstance(answer, str):
            self.request_id = answer
            return None
        self.request_id = answer.request_id
        return answer if self.done(answer) else None

    def done(self, st: RequestStatus) -> bool:
        """Whether ``st`` ends the wait; TimeoutError once the time is up without it."""
        self.seen = st.status
        if st.done:
            return True
        if time.monotonic() >= self.deadline:
            raise TimeoutError(
                f"request {self.request_id} still {st.status} after {self.timeout_s}s"
            )
        return False


# ------------------------------------------------------------------------------ clients


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

    async def _send(self, call: _Call[T]) -> T:
        tries = _Tries(self.retry, self._rng, call)
        while True:
            try:
                resp = await self._http.request(call.method, call.url, **call.kw)
            except RETRYABLE_TRANSPORT:
                if (wait := tries.wait_s(None)) is None:
                    raise
            else:
                if (wait := tries.wait_s(resp)) is None:
                    return call.answer(resp)
            await asyncio.sleep(wait)

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
        parts = _submit_parts(
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
        return await self._send(_submit_call(parts, idempotency_key))

    async def run(
        self,
        *,
        timeout_s: float = 300.0,
        wait_s: float = 30.0,
        idempotency_key: str | None = None,
        **request: Unpack[SubmitArgs],
    ) -> RequestStatus:
        """Submit a request (``request``: what :meth:`submit` takes) and wait for its end:
        one call where it ends within ``wait_s`` (``POST /v1/requests?wait=``, at most the
        server's ``EPD_API_MAX_WAIT_S``), then long-polls as :meth:`wait` for the rest;
        TimeoutError after ``timeout_s``."""
        w = _Wait("", timeout_s)
        read_s = self._http.timeout.read
        parts = _parts_of(request)
        answer = await self._send(_run_call(parts, idempotency_key, w.poll_s(wait_s), read_s))
        if (st := w.first(answer)) is not None:
            return st
        return await self.wait(w.request_id, timeout_s=w.left_s())

    async def submit_vllm(
        self, generate_request: Mapping[str, Any], *, idempotency_key: str | None = None
    ) -> str:
        """Fan out a vLLM render response / GenerateRequest JSON; returns the request id."""
        return await self._send(_submit_vllm_call(generate_request, idempotency_key))

    async def status(
        self, request_id: str, *, wait_s: float = 0.0, changed_from: str | None = None
    ) -> RequestStatus:
        """The request's status; ``wait_s`` long-polls until it changes (from
        ``changed_from``, the last status you saw, when given: then no change is missed)."""
        read_s = self._http.timeout.read
        return await self._send(_status_call(request_id, wait_s, changed_from, read_s))

    async def wait(self, request_id: str, timeout_s: float = 300.0) -> RequestStatus:
        """Long-poll until the request is terminal (one call, however many stages it passes:
        ``until_done``); TimeoutError after ``timeout_s``."""
        w = _Wait(request_id, timeout_s)
        read_s = self._http.timeout.read
        while True:
            st = await self._send(_status_call(request_id, w.poll_s(), w.seen, read_s, True))
            if w.done(st):
                return st

    async def events(
        self, request_id: str, *, last_event_id: str | None = None, tokens: bool = False
    ) -> AsyncIterator[Any]:
        """Every status change as it happens (SSE: :class:`StatusEvent`); ends after the
        terminal one (raises :class:`NotFound`, rule ``status-gone``, if the request's record
        went first). ``tokens``: the :class:`TokenEvent` s too, as the request decodes.
        Resume with ``last_event_id`` (the ``id`` of the last event seen, of either kind)."""
        async with self._http.stream(**_events_stream(request_id, last_event_id)) as resp:
            if resp.status_code >= 400:
                await resp.aread()
                _raise_for(resp)
            sse = _SseReader(tokens)
            async for line in resp.aiter_lines():
                if (ev := sse.feed(line)) is not None:
                    yield ev

    async def cancel(self, request_id: str) -> RequestStatus:
        """Cancel; the answer's status is ``cancelled`` (Conflict if it already finished)."""
        return await self._send(_cancel_call(request_id))


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

    def _send(self, call: _Call[T]) -> T:
        tries = _Tries(self.retry, self._rng, call)
        while True:
            try:
                resp = self._http.request(call.method, call.url, **call.kw)
            except RETRYABLE_TRANSPORT:
                if (wait := tries.wait_s(None)) is None:
                    raise
            else:
                if (wait := tries.wait_s(resp)) is None:
                    return call.answer(resp)
            time.sleep(wait)

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
        parts = _submit_parts(
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
        return self._send(_submit_call(parts, idempotency_key))

    def run(
        self,
        *,
        timeout_s: float = 300.0,
        wait_s: float = 30.0,
        idempotency_key: str | None = None,
        **request: Unpack[SubmitArgs],
    ) -> RequestStatus:
        """See :meth:`EPDClient.run`."""
        w = _Wait("", timeout_s)
        read_s = self._http.timeout.read
        parts = _parts_of(request)
        answer = self._send(_run_call(parts, idempotency_key, w.poll_s(wait_s), read_s))
        if (st := w.first(answer)) is not None:
            return st
        return self.wait(w.request_id, timeout_s=w.left_s())

    def submit_vllm(
        self, generate_request: Mapping[str, Any], *, idempotency_key: str | None = None
    ) -> str:
        """See :meth:`EPDClient.submit_vllm`."""
        return self._send(_submit_vllm_call(generate_request, idempotency_key))

    def status(
        self, request_id: str, *, wait_s: float = 0.0, changed_from: str | None = None
    ) -> RequestStatus:
        """See :meth:`EPDClient.status`."""
        read_s = self._http.timeout.read
        return self._send(_status_call(request_id, wait_s, changed_from, read_s))

    def wait(self, request_id: str, timeout_s: float = 300.0) -> RequestStatus:
        """See :meth:`EPDClient.wait`."""
        w = _Wait(request_id, timeout_s)
        read_s = self._http.timeout.read
        while True:
            st = self._send(_status_call(request_id, w.poll_s(), w.seen, read_s, True))
            if w.done(st):
                return st

    def events(
        self, request_id: str, *, last_event_id: str | None = None, tokens: bool = False
    ) -> Iterator[Any]:
        """See :meth:`EPDClient.events`."""
        with self._http.stream(**_events_stream(request_id, last_event_id)) as resp:
            if resp.status_code >= 400:
                resp.read()
                _raise_for(resp)
            sse = _SseReader(tokens)
            for line in resp.iter_lines():
                if (ev := sse.feed(line)) is not None:
                    yield ev

    def cancel(self, request_id: str) -> RequestStatus:
        """See :meth:`EPDClient.cancel`."""
        return self._send(_cancel_call(request_id))
