"""Pure pieces of the HTTP API: image intake, fingerprints, lag, tenant salts, status views."""

from __future__ import annotations

import base64
import functools
import json
from typing import Any

import pytest
from aiokafka import TopicPartition

from frontend.api.admission import consumer_lag
from frontend.api.errors import ApiError
from frontend.api.submit import native
from frontend.api.submit.media import check_image_bytes, decode_image_string, sniff_image_type
from frontend.api.tenants import Tenants
from frontend.api.views import iso, status_view
from media.sample_images import png_bytes, synthetic_image
from runtime.request_limits import RequestLimits
from runtime.settings import Settings

PNG = png_bytes(synthetic_image(28, 28, seed=1))
LIMIT = 1024 * 1024


def limits_of(s: Settings) -> RequestLimits:
    """The request limits of ``s`` for the tiny model (its vocabulary and context)."""
    info = _tiny_info()
    return RequestLimits.from_settings(
        s, vocab_size=info.vocab_size, model_context=info.context_length
    )


@functools.cache
def _tiny_info() -> Any:
    from runtime.model import load_render_info

    return load_render_info("tiny")


def parse_json_submit(body: bytes, s: Settings) -> Any:
    """The JSON body parser with the request limits of ``s``."""
    return native.parse_json_submit(body, limits_of(s), s)


def _code(exc: pytest.ExceptionInfo[ApiError]) -> tuple[int, str | None]:
    return exc.value.status, exc.value.rule


def test_base64_and_data_urls_decode_to_the_same_bytes() -> None:
    b64 = base64.b64encode(PNG).decode()
    assert decode_image_string(b64, 0, LIMIT) == PNG
    assert decode_image_string(f"data:image/png;base64,{b64}", 0, LIMIT) == PNG
    wrapped = "\n".join(b64[i : i + 76] for i in range(0, len(b64), 76))  # MIME line breaks
    assert decode_image_string(wrapped, 0, LIMIT) == PNG


@pytest.mark.parametrize(
    "text",
    ["/etc/passwd", "./cat.png", "http://example.com/a.png", "file:///etc/hosts", "%%%"],
)
def test_paths_and_urls_are_not_images(text: str) -> None:
    with pytest.raises(ApiError) as e:
        decode_image_string(text, 3, LIMIT)
    assert _code(e) == (400, "image.encoding") and e.value.item == 3


def test_oversize_is_refused_before_decoding_and_types_are_sniffed() -> None:
    with pytest.raises(ApiError) as e:
        decode_image_string("!" * (4 * LIMIT), 0, LIMIT)  # not even base64: size comes first
    assert _code(e) == (413, "image.size")
    with pytest.raises(ApiError) as e:
        decode_image_string("data:image/svg+xml;base64,PHN2Zz4=", 1, LIMIT)
    assert _code(e) == (415, "image.type") and e.value.item == 1
    with pytest.raises(ApiError) as e:
        decode_image_string("data:image/png,rawtext", 0, LIMIT)
    assert _code(e) == (400, "image.encoding")
    assert sniff_image_type(PNG) == "image/png"
    assert sniff_image_type(b"\xff\xd8\xff\xe0rest") == "image/jpeg"
    assert sniff_image_type(b"GIF89a....") == "image/gif"
    assert sniff_image_type(b"RIFF\x00\x00\x00\x00WEBPVP8 ") == "image/webp"
    assert sniff_image_type(b"RIFF\x00\x00\x00\x00WAVEfmt ") is None
    assert sniff_image_type(b"%!PS-Adobe-3.0 EPSF-3.0") is None
    with pytest.raises(ApiError) as e:
        check_image_bytes(b"%!PS-Adobe-3.0 EPSF-3.0\n", 2, LIMIT)
    assert _code(e) == (415, "image.type") and e.value.item == 2
    with pytest.raises(ApiError) as e:
        check_image_bytes(PNG, 0, len(PNG) - 1)
    assert _code(e) == (413, "image.size")


def test_fingerprint_is_about_meaning_not_bytes() -> None:
    s = Settings()
    b64 = base64.b64encode(PNG).decode()
    a = parse_json_submit(
        f'{{"prompt": "<image>", "images": ["{b64}"], "max_tokens": 4}}'.encode(), s
    )
    reordered = {"max_tokens": 4, "images": [f"data:image/png;base64,{b64}"], "prompt": "<image>"}
    b = parse_json_submit(json.dumps(reordered).encode(), s)
    c = parse_json_submit(
        f'{{"prompt": "<image>", "images": ["{b64}"], "max_tokens": 5}}'.encode(), s
    )
    assert a.fingerprint() == b.fingerprint() != c.fingerprint()


def test_json_submit_errors_name_the_field() -> None:
    s = Settings()
    with pytest.raises(ApiError) as e:
        parse_json_submit(b"[1, 2]", s)
    assert _code(e) == (400, "body.json")
    with pytest.raises(ApiError) as e:
        parse_json_submit(b'{"prompt": "x", "max_tokens": "many"}', s)
    assert _code(e) == (422, "request.schema") and e.value.field == "max_tokens"
    too_many = ",".join(['"x"'] * (s.api_max_images + 1))
    with pytest.raises(ApiError) as e:
        parse_json_submit(f'{{"prompt": "x", "images": [{too_many}]}}'.encode(), s)
    assert _code(e) == (413, "image.count")


def test_consumer_lag_counts_unconsumed_events() -> None:
    a, b = TopicPartition("t", 0), TopicPartition("t", 1)
    assert consumer_lag({a: 10, b: 5}, {a: 7}) == 3 + 5
    assert consumer_lag({a: 10}, {a: 12}) == 0


async def test_the_lag_sampler_sleeps_while_no_admission_asks() -> None:
    """The encode lag is sampled at start, then only while admissions ask for it."""
    import asyncio

    from frontend.api.admission import LagMonitor
    from schemas.topics import Topics

    mon = LagMonitor(Settings(), Topics("p"), interval_s=0.01, idle_after_s=0.1)

    async def connect() -> tuple[None, None]:
        return None, None

    async def sample(*_: object) -> int:
        return 7

    mon._connect = connect  # type: ignore[method-assign]
    mon.sample = sample  # type: ignore[method-assign]
    await mon.start()
    try:
        await asyncio.sleep(0.6)
        quiet = mon.samples
        assert 1 <= quiet <= 25, quiet  # about 0.1 s worth of samples, not 0.6 s
        assert mon.lag == 7
        assert not mon.over(0)  # disabled: asks for nothing
        await asyncio.sleep(0.1)
        assert mon.samples == quiet
        assert mon.over(5)  # a fresh sample above the limit; asking wakes the sampler
        await asyncio.sleep(0.1)
        assert mon.samples > quiet
    finally:
        await mon.close()


def test_tenant_salt_keeps_tenants_apart_whatever_salt_they_send() -> None:
    tenants = Tenants({"tok-a": "alice", "tok-b": "bob"}, secret=b"s" * 32)
    tenant_salt = tenants.salt
    assert tenant_salt("alice", None) != tenant_salt("bob", None)
    assert tenant_salt("alice", "x") != tenant_salt("bob", "x")
    # a tenant cannot pick a salt that lands in another tenant's namespace
    assert tenant_salt("alice", "y") != tenant_salt("bob", None)
    assert tenant_salt("mallory", "tenant:bob") != tenant_salt("bob", None)
    assert tenant_salt("a", "b:c") != tenant_salt("a:b", "c") != tenant_salt("a:b:c", None)
    # every replica with the same secret derives the same salt; another secret does not
    again = Tenants({"tok-a": "alice"}, secret=b"s" * 32)
    assert again.salt("alice", "x") == tenant_salt("alice", "x")
    assert Tenants({}, secret=b"t" * 32).salt("alice", "x") != tenant_salt("alice", "x")


@pytest.mark.parametrize("tenant", ["alice", "bob"])
def test_no_client_salt_on_an_open_api_equals_a_tenant_salt(tenant: str) -> None:
    """An open replica (no tokens) beside tenanted ones: whatever salt a client sends, even
    a tenant's derived salt itself or the old plain-text form, it runs in the client
    namespace, never as that tenant's."""
    secret = b"k" * 32
    tenanted = Tenants({"tok": tenant}, secret=secret)
    open_api = Tenants({}, secret=secret)
    theirs = {tenanted.salt(tenant, None), tenanted.salt(tenant, "x")}
    forged = [
        *theirs,
        f'tenant:["{tenant}", null]',
        "tenant:" + json.dumps([tenant, None]),
        "",
        "x",
    ]
    assert open_api.open
    for salt in forged:
        assert open_api.salt(None, salt) not in theirs
    assert open_api.salt(None, None) is None  # no salt: the shared open namespace


def test_status_view_stages_and_items() -> None:
    """The record is folded from the updates the stages really send (the encoder's per-item
    marks included), not built by hand: a view reading a key nothing writes shows up here."""
    from schemas.status_record import created, encoded_update, fold
    from schemas.types import ResultEvent

    a, b = "a" * 64, "b" * 64
    rec = created(
        "r",
        {
            "render": {"started_ms": 1_000, "finished_ms": 1_050, "ms": 48.0},
            "items": [
                {"modality": "image", "index": 0, "mm_hash": a},
                {"modality": "image", "index": 1, "mm_hash": b},
            ],
            "cached": [],
        },
        at_ms=1_000,
    )
    updates = [
        ResultEvent("r", "fanout", "encoding", created_ms=1_100),
        encoded_update(_encoded(a, 40.0, 1_200)),
        encoded_update(_encoded(b, 10.0, 1_250)),
        ResultEvent("r", "prefill", "prefilling", created_ms=1_300),
        ResultEvent("r", "prefill", "decoding", created_ms=1_350),
        ResultEvent("r", "prefill", "completed", token_ids=[1, 2], text="hi", created_ms=1_500),
    ]
    for ev in updates:
        rec = fold(rec, ev) or rec
    v = status_view(rec)
    assert v["created_at"] == iso(1_000) == "1970-01-01T00:00:01.000Z"
    assert v["stages"]["render"]["ms"] == 48.0
    assert v["stages"]["encode"] == {"started": iso(1_100), "finished": iso(1_250), "ms": 50.0}
    assert v["stages"]["prefill"]["ms"] == 50.0 and v["stages"]["decode"]["ms"] == 150.0
    assert [(i["cache_hit"], i["encoded"]) for i in v["items"]] == [(False, True), (False, True)]
    assert v["result"] == {"token_ids": [1, 2], "text": "hi"}


def _encoded(mm_hash: str, ms: float, at: int) -> Any:
    from schemas.types import EncodedEvent

    return EncodedEvent(
        mm_hash,
        "r",
        "m",
        "redis://",
        f"ec:x:{mm_hash}",
        "fp32",
        [4, 8],
        encode_ms=ms,
        created_ms=at,
    )


def test_a_cancelled_record_shows_the_tokens_it_has() -> None:
    """A request cancelled mid-decode: when its record holds the tokens generated before the
    cancel took effect, the view returns them with the ``cancelled`` status."""
    from schemas.status_record import StatusRecord

    rec = StatusRecord(
        "r",
        status="cancelled",
        created_ms=1_000,
        stages={"api:cancelled": 1_400},
        token_ids=[5, 6, 7],
        text="abc",
        error={"code": "cancelled", "message": "cancelled by the client"},
    )
    v = status_view(rec)
    assert v["status"] == "cancelled" and v["result"] == {"token_ids": [5, 6, 7], "text": "abc"}
    assert v["error"]["code"] == "cancelled"


def test_api_statuses_are_the_pipelines_statuses() -> None:
    """The API's status literal and the event contract's status table name the same set."""
    from typing import get_args

    from frontend.api.protocol import Status
    from schemas.types import STATUSES

    assert set(get_args(Status)) == set(STATUSES)


def test_a_forms_image_files_weigh_a_share_toward_the_thread_hop_its_strings_whole() -> None:
    from frontend.api.submit.reading import FILE_WALK_SHARE, OFF_LOOP_BYTES

    door = native.NativeDoor(st=None)  # type: ignore[arg-type]  # work_bytes reads no state
    photo = png_bytes(synthetic_image(224, 224, seed=2))
    as_text = base64.b64encode(photo).decode()
    assert OFF_LOOP_BYTES < len(photo) < OFF_LOOP_BYTES * FILE_WALK_SHARE
    form = native.NativeBody(fields={"prompt": "x"}, images=[photo])
    # A 224² file is walked on the loop; the same image as a string is decoded in a thread.
    assert door.work_bytes(form, len(photo) + 200) == len(photo) // FILE_WALK_SHARE
    assert door.work_bytes(form, len(photo) + 200) <= OFF_LOOP_BYTES
    strings = native.NativeBody(fields={"prompt": "x"}, images=[as_text, photo])
    assert door.work_bytes(strings, 0) == len(as_text) + len(photo) // FILE_WALK_SHARE
    assert door.work_bytes(strings, 0) > OFF_LOOP_BYTES
    json_body = native.NativeBody(fields={"prompt": "x", "images": [as_text]})
    assert door.work_bytes(json_body, 123_456) == 123_456  # a JSON body: all of it
