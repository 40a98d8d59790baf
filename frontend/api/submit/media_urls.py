"""Fetching an image or video a request names by an ``http(s)`` URL, only where the operator
allows it.

The allow-list is ``EPD_API_IMAGE_URL_HOSTS`` (:mod:`runtime.url_hosts`; empty by default: no
URL is fetched and no request makes the API connect anywhere). A URL is checked before any
connection: the scheme (``http``/``https``), no user info, and its host and port in the list. The
fetch is bounded in time (``EPD_API_IMAGE_URL_TIMEOUT_S``, redirects included) and size (the
route's byte limit, counted while the body streams in; a larger ``Content-Length`` is refused
before its body is read). All the fetches of one request share a :class:`FetchTotal`
(``EPD_API_MAX_FETCHED_BYTES``, the sum counted chunk by chunk across its concurrent fetches),
and a process runs at most ``EPD_API_IMAGE_URL_CONCURRENCY`` fetches at once (the others wait
for a slot), so what fetches hold is bounded per request and per process. Redirects are
followed by hand, at most ``EPD_API_IMAGE_URL_MAX_REDIRECTS``, and only to the same host and
port: a redirect elsewhere is refused, never followed. The connection goes to the host as the
list compared it, and the body is taken as sent (``identity``; an encoded body is refused,
never decoded). Proxies from the environment are not used (``trust_env=False``): the
connection goes where the URL says, or nowhere.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import httpx

from frontend.api.errors import bad_request
from runtime.settings import Settings
from runtime.url_hosts import UrlHosts, normalise_host
from schemas.errors import ValidationError

SCHEMES = ("http", "https")
DEFAULT_PORTS = {"http": 80, "https": 443}


@dataclass(slots=True)
class FetchTotal:
    """The bytes one request's fetches have taken together, held to ``limit``
    (``EPD_API_MAX_FETCHED_BYTES``) as they stream in."""

    limit: int
    used: int = 0

    def room(self) -> int:
        """Bytes the request's fetches may still take."""
        return self.limit - self.used

    def add(self, n: int, ref: MediaRef) -> None:
        """Count ``n`` more bytes of the item at ``ref``; 413 ``image_url.total`` past the
        limit (the item that crossed it is named)."""
        self.used += n
        if self.used > self.limit:
            raise ValidationError(
                "image_url.total",
                f"the media URLs of this request fetch more than {self.limit} bytes together "
                f"(EPD_API_MAX_FETCHED_BYTES; this {ref.modality} crossed it)",
                field=ref.field,
                item=ref.item,
                modality=ref.modality,
            )


@dataclass(frozen=True, slots=True)
class MediaRef:
    """Where a request's URL-named item is, for messages: its field and item index."""

    field: str
    item: int
    modality: str


def _port(url: httpx.URL) -> int:
    return url.port or DEFAULT_PORTS.get(url.scheme, 0)


def _as_compared(url: httpx.URL) -> httpx.URL:
    """``url`` with its host as the allow-list compares it (lower case, no trailing dot, an IP
    in its canonical spelling), so the connection goes to the host that was allowed: an
    allowed ``127.0.0.1`` written ``127.0.0.1.`` would otherwise be looked up as a name."""
    return url.copy_with(host=normalise_host(url.host))


class MediaFetcher:
    """Fetches allowed media URLs (see the module docstring)."""

    def __init__(
        self,
        hosts: UrlHosts,
        *,
        timeout_s: float = 10.0,
        max_redirects: int = 3,
        max_total: int = 32 * 1024 * 1024,
        concurrency: int = 4,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.hosts = hosts
        self.timeout_s = timeout_s
        self.max_redirects = max_redirects
        self.max_total = max_total
        """Bytes one request's fetches take together (:meth:`total` starts its count)."""
        self.slots = asyncio.Semaphore(concurrency)
        """Fetches running at once in this process."""
        self._transport = transport

    @classmethod
    def from_settings(cls, settings: Settings) -> MediaFetcher:
        return cls(
            settings.url_hosts(),
            timeout_s=settings.api_image_url_timeout_s,
            max_redirects=settings.api_image_url_max_redirects,
            max_total=settings.api_max_fetched_bytes,
            concurrency=settings.api_image_url_concurrency,
        )

    def total(self) -> FetchTotal:
        """A new request's count of fetched bytes (pass it to each of its fetches)."""
        return FetchTotal(self.max_total)

    def check(self, text: str, ref: MediaRef) -> httpx.URL:
        """The URL, when it may be fetched; 400 ``image_url.scheme`` / ``image_url.host``
        otherwise (nothing is connected to)."""
        try:
            url = httpx.URL(text)
        except (httpx.InvalidURL, TypeError, ValueError):
            raise bad_request(
                "not a URL", rule="image_url.scheme", field=ref.field, item=ref.item
            ) from None
        if url.scheme not in SCHEMES or not url.host:
            raise bad_request(
                "give a data: URL (base64) or an http(s) URL",
                rule="image_url.scheme",
                field=ref.field,
                item=ref.item,
            )
        if url.userinfo:
            raise bad_request(
                "a media URL may not carry a user name or password",
                rule="image_url.host",
                field=ref.field,
                item=ref.item,
            )
        if not self.hosts.allows(url.host, _port(url)):
            where = (
                "this server fetches no URLs (EPD_API_IMAGE_URL_HOSTS is empty); send the "
                "file as a data: URL"
                if not self.hosts
                else f"host {url.host!r} (port {_port(url)}) is not in EPD_API_IMAGE_URL_HOSTS"
            )
            raise bad_request(where, rule="image_url.host", field=ref.field, item=ref.item)
        return _as_compared(url)

    async def fetch(
        self, text: str, ref: MediaRef, limit: int, total: FetchTotal | None = None
    ) -> bytes:
        """The bytes at an allowed URL, at most ``limit`` of them (and at most what
        ``total``, the request's count, has room for), once a fetch slot is free.
        ``ValidationError``: ``image_url.fetch`` (no answer in time, an error status, a
        redirect elsewhere), ``image_url.size`` (over ``limit``), ``image_url.total`` (the
        request's fetches together over ``EPD_API_MAX_FETCHED_BYTES``)."""
        url = self.check(text, ref)
        total = total or self.total()
        async with self.slots:
            return await self._timed(url, ref, limit, total)

    async def _timed(self, url: httpx.URL, ref: MediaRef, limit: int, total: FetchTotal) -> bytes:
        try:
            async with asyncio.timeout(self.timeout_s):
                return await self._get(url, ref, limit, total)
        except TimeoutError:
            raise self._failed(
                ref, f"no answer within {self.timeout_s:g} s (EPD_API_IMAGE_URL_TIMEOUT_S)"
            ) from None
        except httpx.HTTPError as exc:
            raise self._failed(ref, f"cannot fetch it: {type(exc).__name__}: {exc}") from None

    async def _get(self, url: httpx.URL, ref: MediaRef, limit: int, total: FetchTotal) -> bytes:
        async with httpx.AsyncClient(
            follow_redirects=False,
            trust_env=False,
            transport=self._transport,
            headers={"accept-encoding": "identity"},
        ) as client:
            for _ in range(self.max_redirects + 1):
                async with client.stream("GET", url) as resp:
                    if resp.is_redirect:
                        url = self._redirect(url, resp, ref)
                        continue
                    if resp.status_code != 200:
                        raise self._failed(ref, f"the server answered {resp.status_code}")
                    return await self._body(resp, ref, limit, total)
        raise self._failed(
            ref, f"more than {self.max_redirects} redirects (EPD_API_IMAGE_URL_MAX_REDIRECTS)"
        )

    def _redirect(self, url: httpx.URL, resp: httpx.Response, ref: MediaRef) -> httpx.URL:
        """The redirect's target, when it stays on the same host and port."""
        location = resp.headers.get("location")
        if not location:
            raise self._failed(ref, f"a redirect ({resp.status_code}) without a Location")
        try:
            target = url.join(location)
            target = _as_compared(target) if target.host else target
        except (httpx.InvalidURL, TypeError, ValueError):
            raise self._failed(ref, f"a redirect to {location[:200]!r}, not a URL") from None
        same = (
            target.scheme in SCHEMES
            and not target.userinfo
            and (target.host, _port(target)) == (url.host, _port(url))
        )
        if not same:
            raise self._failed(
                ref, "it redirects to another host, which is never followed", rule="image_url.host"
            )
        return target

    async def _body(
        self, resp: httpx.Response, ref: MediaRef, limit: int, total: FetchTotal
    ) -> bytes:
        """The body as sent, at most ``limit`` bytes. An encoded body (``Content-Encoding``,
        asked for ``identity``) is refused, never decoded: a decoder expands each chunk read
        (gzip about 1000 times) before any size check could see it, and images and videos
        are compressed already."""
        encoding = resp.headers.get("content-encoding", "identity").strip().lower()
        if encoding not in ("", "identity"):
            raise self._failed(
                ref, f"the server sent a {encoding[:40]!r}-encoded body; only identity is taken"
            )
        declared = resp.headers.get("content-length", "")
        if declared.isascii() and declared.isdigit():
            if int(declared) > limit:
                raise _too_large(int(declared), limit, ref)
            if int(declared) > total.room():
                total.add(int(declared), ref)  # refused before its body is read
        chunks: list[bytes] = []
        size = 0
        async for chunk in resp.aiter_bytes():  # identity: nothing is decoded
            size += len(chunk)
            if size > limit:
                raise _too_large(size, limit, ref)
            total.add(len(chunk), ref)  # the request's other fetches count too
            chunks.append(chunk)
        return b"".join(chunks)

    @staticmethod
    def _failed(ref: MediaRef, why: str, *, rule: str = "image_url.fetch") -> ValidationError:
        return ValidationError(
            rule,
            f"the {ref.modality} URL: {why}",
            field=ref.field,
            item=ref.item,
            modality=ref.modality,
        )


def _too_large(size: int, limit: int, ref: MediaRef) -> ValidationError:
    return ValidationError(
        "image_url.size",
        f"the {ref.modality} at the URL is at least {size} bytes; the limit is {limit}",
        field=ref.field,
        item=ref.item,
        modality=ref.modality,
    )
