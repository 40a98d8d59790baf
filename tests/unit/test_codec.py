"""Codec: single-object framing, every event type and dtype, and garbage in -> CodecError only."""

from __future__ import annotations

import io
import random

import pytest
import torch
from fastavro import schemaless_writer
from fastavro.schema import fingerprint as fastavro_fingerprint
from hypothesis import given, settings
from hypothesis import strategies as st

from schemas.codec import EVENT_SCHEMAS, MAGIC, fingerprint, get_codec
from schemas.errors import CodecError
from schemas.tensors import DTYPES
from schemas.types import (
    DeadLetter,
    ECTransfer,
    EncodedEvent,
    EncodeEvent,
    ErrorInfo,
    Features,
    PlaceholderRange,
    PrefillEvent,
    RenderEvent,
    ResultEvent,
    SamplingParams,
    TensorRef,
)


def _tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(max(info.min, -1000), min(info.max, 1000), shape, generator=g).to(dtype)


def _features() -> Features:
    grid = torch.tensor([[1, 4, 6]], dtype=torch.int64)
    pixels = _tensor(torch.bfloat16, (24, 1176))
    return Features(
        mm_hashes={"image": ["a" * 64, "b" * 64], "audio": ["c" * 64]},
        mm_placeholders={
            "image": [PlaceholderRange(2, 6), PlaceholderRange(10, 6, [True] * 6)],
            "audio": [PlaceholderRange(20, 3)],
        },
        kwargs_data={
            "image": [{"pixel_values": pixels, "image_grid_thw": grid}, None],
            "audio": [None],
        },
        mm_metadata={
            "image": [{"image_grid_thw": grid}, {"image_grid_thw": grid}],
            "audio": [None],
        },
    )


def _ec(h: str) -> ECTransfer:
    return ECTransfer(h, "redis://127.0.0.1:6379/0", f"ec:fp:{h}", 1_900_000_000_000, "ab" * 32)


def _events() -> list[object]:
    err = ErrorInfo("rejected", "metadata-only item", "ec-transfer-required", "image", 1, None)
    ref = TensorRef(
        "redis://127.0.0.1:6379/0", "claim:x", "bfloat16", [24, 1176], 24 * 1176 * 2, "d"
    )
    return [
        RenderEvent(
            "r1",
            "tiny",
            [1, 2, 3],
            _features(),
            SamplingParams(8, 0.0, [7], True),
            cache_salt="tenant-a",
            deadline_ms=123,
            trace={"traceparent": "00-abc-def-01"},
        ),
        EncodeEvent(
            "r1",
            "tiny",
            "image",
            0,
            "a" * 64,
            {
                "pixel_values": _tensor(torch.float32, (24, 1176)),
                "image_grid_thw": torch.ones(1, 3),
            },
            _ec("a" * 64),
        ),
        EncodeEvent("r1", "tiny", "image", 1, "b" * 64, {"pixel_values": ref}, _ec("b" * 64)),
        PrefillEvent(
            "r1",
            "tiny",
            list(range(30)),
            Features(
                {"image": ["a" * 64]},
                {"image": [PlaceholderRange(1, 6)]},
                None,
                {"image": [{"image_grid_thw": torch.tensor([[1, 4, 6]])}]},
            ),
            {"a" * 64: _ec("a" * 64)},
        ),
        EncodedEvent("a" * 64, "r1", "tiny", "redis://", "ec:fp:a", "float32", [6, 64]),
        EncodedEvent("a" * 64, "r1", "tiny", "redis://", "k", "float32", [0], ok=False, error=err),
        ResultEvent("r1", "prefill", "completed", [5, 6], "hi", None, {"prefill": 1.5}, {"a": "b"}),
        ResultEvent("r2", "prefill", "rejected", error=err),
        DeadLetter("epd.prefill", 3, 42, b"r1", b"\x00garbage", "epd-prefill", err, 3, {"x": b"y"}),
    ]


def _assert_same(a: object, b: object) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor)
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a, b)
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys()
        for k in a:
            _assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)  # type: ignore[arg-type]
        for x, y in zip(a, b, strict=True):  # type: ignore[call-overload]
            _assert_same(x, y)
    elif hasattr(a, "__slots__") and not isinstance(a, (str, bytes)):
        assert type(a) is type(b)
        for name in a.__slots__:  # type: ignore[attr-defined]
            _assert_same(getattr(a, name), getattr(b, name))
    else:
        assert a == b


@pytest.mark.parametrize("event", _events(), ids=lambda e: type(e).__name__)
def test_round_trip_every_event_type(event: object) -> None:
    codec = get_codec()
    data = codec.encode(event)  # type: ignore[arg-type]
    assert data[:2] == MAGIC
    assert codec.peek(data) == codec.schema_name(event)  # type: ignore[arg-type]
    _assert_same(event, codec.decode(data))


@pytest.mark.parametrize("dtype_name", sorted(DTYPES))
@pytest.mark.parametrize("shape", [(), (0,), (3,), (2, 5, 7)])
def test_round_trip_every_dtype(dtype_name: str, shape: tuple[int, ...]) -> None:
    t = _tensor(DTYPES[dtype_name], shape, seed=len(shape))
    ev = EncodeEvent("r", "m", "image", 0, "h", {"x": t}, _ec("h"))
    out = get_codec().decode(get_codec().encode(ev), EncodeEvent)
    got = out.data["x"]
    assert isinstance(got, torch.Tensor)
    assert got.dtype == t.dtype and tuple(got.shape) == shape
    assert torch.equal(got, t)


def test_bf16_bit_exact() -> None:
    # bf16 has no numpy twin; the bytes must survive unchanged, NaN payloads included.
    raw = torch.arange(0, 65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    ev = EncodeEvent("r", "m", "image", 0, "h", {"x": raw}, _ec("h"))
    got = get_codec().decode(get_codec().encode(ev), EncodeEvent).data["x"]
    assert isinstance(got, torch.Tensor)
    assert torch.equal(got.view(torch.int16), raw.view(torch.int16))


def test_decode_is_zero_copy_view_over_the_datum() -> None:
    t = torch.arange(1 << 16, dtype=torch.float32)
    ev = EncodeEvent("r", "m", "image", 0, "h", {"x": t}, _ec("h"))
    got = get_codec().decode(get_codec().encode(ev), EncodeEvent).data["x"]
    assert isinstance(got, torch.Tensor)
    # frombuffer views the decoded bytes object: the storage is not owned by a fresh allocation
    # larger than the data, and the tensor is exactly the bytes we sent.
    assert got.untyped_storage().nbytes() == t.numel() * 4
    assert torch.equal(got, t)


# The fingerprints every frame on the wire carries today. They must never change by accident:
# a new value makes every reader in the field refuse old frames ("unknown schema fingerprint").
PINNED_FINGERPRINTS = {
    "epd.RenderEvent": "a15492e4fde01648",  # v2: sampling fields, kv_transfer_params
    "epd.EncodeEvent": "3bcb85c179737334",
    "epd.PrefillEvent": "0ad5a59ed30e92d8",  # v2 (v1 frames still decode)
    "epd.DecodeEvent": "2b4fe623e1b42112",  # v2: the decode stage
    "epd.EncodedEvent": "bd7915765d7a8780",
    "epd.ResultEvent": "2c865b01b931cff5",
    "epd.DeadLetter": "c8b3827170e5e499",
}


def test_fingerprints_are_pinned() -> None:
    codec = get_codec()
    assert {n: fingerprint(codec.schema(n)).hex() for n in EVENT_SCHEMAS} == PINNED_FINGERPRINTS
    for fp, name in codec.fingerprints.items():  # frozen versions: the table's key is the frame's
        assert name in PINNED_FINGERPRINTS and len(fp) == 8


def test_fingerprint_is_the_avro_specs_crc64() -> None:
    # Known value from the Avro spec: CRC-64-AVRO of the schema "null" is 0x63dd24e7cc258f8a,
    # framed little-endian.
    assert fingerprint("null") == (0x63DD24E7CC258F8A).to_bytes(8, "little")
    assert fastavro_fingerprint('"null"', "CRC-64-AVRO") == fingerprint("null").hex()


def test_expect_type_mismatch() -> None:
    data = get_codec().encode(ResultEvent("r", "api", "queued"))
    with pytest.raises(CodecError, match=r"expected PrefillEvent, got epd\.ResultEvent"):
        get_codec().decode(data, PrefillEvent)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"", "truncated frame"),
        (b"\xc3\x01\x00", "truncated frame"),
        (b"\x00\x01" + bytes(8) + b"x", "not an Avro single-object frame"),
        (MAGIC + bytes(8), "unknown schema fingerprint"),
    ],
)
def test_bad_frames(data: bytes, message: str) -> None:
    with pytest.raises(CodecError, match=message):
        get_codec().decode(data)


def test_truncated_and_trailing_bytes() -> None:
    data = get_codec().encode(_events()[0])  # type: ignore[arg-type]
    for cut in (11, 50, len(data) // 2, len(data) - 1):
        with pytest.raises(CodecError):
            get_codec().decode(data[:cut])
    with pytest.raises(CodecError, match="trailing bytes"):
        get_codec().decode(data + b"\x00")


def test_tensor_size_mismatch_is_codec_error() -> None:
    codec = get_codec()
    parsed, fp = codec.schema("epd.EncodeEvent"), fingerprint(codec.schema("epd.EncodeEvent"))
    record = {
        "request_id": "r",
        "model": "m",
        "modality": "image",
        "item_index": 0,
        "mm_hash": "h",
        "data": {"x": ("epd.Tensor", {"dtype": "float32", "shape": [4, 4], "data": b"\x00" * 10})},
        "ec_transfer": {
            "mm_hash": "h",
            "store": "s",
            "key": "k",
            "expires_ms": 0,
            "signature": "",
        },
        "deadline_ms": None,
        "created_ms": 0,
        "trace": {},
    }
    buf = io.BytesIO()
    buf.write(MAGIC + fp)
    schemaless_writer(buf, parsed, record)
    with pytest.raises(CodecError, match=r"needs 64 bytes, got 10"):
        codec.decode(buf.getvalue())


def test_encode_rejects_non_event() -> None:
    with pytest.raises(CodecError, match="not an event type"):
        get_codec().encode(object())  # type: ignore[arg-type]


def test_encode_rejects_unsupported_dtype() -> None:
    ev = EncodeEvent(
        "r", "m", "image", 0, "h", {"x": torch.zeros(2, dtype=torch.complex64)}, _ec("h")
    )
    with pytest.raises(CodecError, match="not supported on the wire"):
        get_codec().encode(ev)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=512))
def test_fuzz_random_bytes_only_codec_error(blob: bytes) -> None:
    try:
        get_codec().decode(blob)
    except CodecError:
        pass


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(range(len(EVENT_SCHEMAS))), st.binary(max_size=512))
def test_fuzz_valid_header_random_datum_only_codec_error(i: int, blob: bytes) -> None:
    codec = get_codec()
    fp = fingerprint(codec.schema(EVENT_SCHEMAS[i]))
    try:
        codec.decode(MAGIC + fp + blob)
    except CodecError:
        pass


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_fuzz_bit_flips_only_codec_error(data: st.DataObject) -> None:
    events = _events()
    ev = events[data.draw(st.integers(0, len(events) - 1))]
    raw = bytearray(get_codec().encode(ev))  # type: ignore[arg-type]
    rng = random.Random(data.draw(st.integers(0, 2**32)))
    for _ in range(data.draw(st.integers(1, 8))):
        pos = rng.randrange(len(raw))
        raw[pos] ^= 1 << rng.randrange(8)
    try:
        get_codec().decode(bytes(raw))
    except CodecError:
        pass
