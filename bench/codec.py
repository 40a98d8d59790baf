"""Codec speed: Avro EncodeEvent vs vLLM's JSON/base64/msgpack request for the same item.

The item is one 1024x1024 image through Qwen2-VL's processor (``pixel_values`` 5476 x 1176,
fp32 as the processor emits it and bf16 as a GPU deployment would ship it, plus the grid).

- ``avro``: ``schemas.codec`` encode of an ``EncodeEvent`` carrying the item inline, then
  decode back to tensors (a zero-copy view over the bytes fastavro read out of the frame).
- ``vllm_json``: the encode request vLLM's scale-out path sends for that item: a
  ``GenerateRequest`` whose ``kwargs_data`` holds the item as base64 of msgpack
  (``schemas.vllm_wire``), ``json.dumps`` to the HTTP body; then ``json.loads`` and
  ``parse_generate_request`` back to tensors.

Tensor decode is also set against a plain copy of the same number of bytes: ``bytearray(frame)``
(a fresh buffer, as every decoder that does not alias its input must allocate) and
``numpy.copyto`` into a buffer allocated once (pure memcpy bandwidth, the stricter baseline).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench.common import budget, headroom, measure, ratio, rendered_1024, sig
from schemas.types import ItemData

MIN_SPEEDUP = 5.0
MAX_DECODE_VS_MEMCPY = 2.0


def _encode_event(item: ItemData, event: Any) -> Any:
    from schemas.keys import embedding_key
    from schemas.signing import make_ec_transfer
    from schemas.types import EncodeEvent, now_ms

    mm_hash = event.features.mm_hashes["image"][0]
    ec = make_ec_transfer(
        mm_hash=mm_hash,
        store="redis://127.0.0.1:6379/0",
        key=embedding_key("ec", "bench", mm_hash),
        expires_ms=now_ms() + 600_000,
        secret=b"bench-secret",
    )
    return EncodeEvent(
        request_id=event.request_id,
        model=event.model,
        modality="image",
        item_index=0,
        mm_hash=mm_hash,
        data=item,
        ec_transfer=ec,
    )


def _vllm_request(item: ItemData, ev: Any, event: Any) -> Any:
    """The GenerateRequest vLLM's scale-out path sends to an encoder for this one item."""
    from schemas.types import Features
    from schemas.vllm_wire import GenerateRequest

    f = event.features
    ec = ev.ec_transfer
    return GenerateRequest(
        token_ids=list(event.token_ids),
        features=Features(
            mm_hashes={"image": [ev.mm_hash]},
            mm_placeholders={"image": [f.mm_placeholders["image"][0]]},
            kwargs_data={"image": [item]},
            mm_metadata={"image": [{"image_grid_thw": item["image_grid_thw"]}]},
        ),
        sampling_params={"max_tokens": 1, "temperature": 0.0},
        request_id=f"{event.request_id}-encode-image-0",
        model=event.model,
        ec_transfer_params={
            ev.mm_hash: {
                "mm_hash": ec.mm_hash,
                "store": ec.store,
                "key": ec.key,
                "expires_ms": ec.expires_ms,
                "signature": ec.signature,
            }
        },
    )


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def _bench_dtype(event: Any, dtype: torch.dtype, repeat: int, warmup: int) -> dict[str, Any]:
    from schemas.codec import get_codec
    from schemas.tensors import tensor_from_bytes
    from schemas.types import EncodeEvent
    from schemas.vllm_wire import generate_request_to_json, parse_generate_request

    codec = get_codec()
    src = event.features.kwargs_data["image"][0]
    pv = src["pixel_values"].to(dtype).contiguous()
    item: ItemData = {"pixel_values": pv, "image_grid_thw": src["image_grid_thw"]}
    ev = _encode_event(item, event)
    req = _vllm_request(item, ev, event)

    # Correctness first: both paths must give back exactly the tensors they were given.
    frame = codec.encode(ev)
    back = codec.decode(frame, EncodeEvent)
    body = json.dumps(generate_request_to_json(req), separators=(",", ":")).encode()
    parsed = parse_generate_request(json.loads(body))
    assert parsed.features is not None and parsed.features.kwargs_data is not None
    vback = parsed.features.kwargs_data["image"][0]
    assert vback is not None
    for name, t in item.items():
        if not (_same(back.data[name], t) and _same(vback[name], t)):  # type: ignore[arg-type]
            raise AssertionError(f"{name} did not round-trip ({dtype})")

    avro_enc = measure(lambda: codec.encode(ev), repeat, warmup)
    avro_dec = measure(lambda: codec.decode(frame, EncodeEvent), repeat, warmup)
    avro_rt = measure(lambda: codec.decode(codec.encode(ev), EncodeEvent), repeat, warmup)

    def vllm_encode() -> bytes:
        return json.dumps(generate_request_to_json(req), separators=(",", ":")).encode()

    def vllm_decode() -> Any:
        return parse_generate_request(json.loads(body))

    vllm_enc = measure(vllm_encode, repeat, warmup)
    vllm_dec = measure(vllm_decode, repeat, warmup)
    vllm_rt = measure(lambda: parse_generate_request(json.loads(vllm_encode())), repeat, warmup)

    # Tensor decode vs memcpy of the same bytes (the whole frame: what decode has to read).
    view = memoryview(frame)
    dst = np.empty(len(frame), dtype=np.uint8)
    src_np = np.frombuffer(frame, dtype=np.uint8)
    copy_fresh = measure(lambda: bytearray(view), repeat, warmup)
    copy_prealloc = measure(lambda: np.copyto(dst, src_np), repeat, warmup)
    raw = pv.reshape(-1).view(torch.uint8).numpy().tobytes()
    shape = list(pv.shape)
    dname = str(dtype).removeprefix("torch.")
    view_only = measure(lambda: tensor_from_bytes(dname, shape, raw), repeat, warmup)

    nbytes = len(frame)
    return {
        "pixel_values_bytes": pv.numel() * pv.element_size(),
        "avro_frame_bytes": nbytes,
        "vllm_body_bytes": len(body),
        "avro": {
            "encode": avro_enc.to_json(),
            "decode": avro_dec.to_json(),
            "roundtrip": avro_rt.to_json(),
            "roundtrip_mb_s": sig(nbytes / avro_rt.p50 / 1e6),
        },
        "vllm_json": {
            "encode": vllm_enc.to_json(),
            "decode": vllm_dec.to_json(),
            "roundtrip": vllm_rt.to_json(),
            "roundtrip_mb_s": sig(nbytes / vllm_rt.p50 / 1e6),
        },
        "speedup_encode": ratio(vllm_enc.p50, avro_enc.p50),
        "speedup_decode": ratio(vllm_dec.p50, avro_dec.p50),
        "speedup_roundtrip": ratio(vllm_rt.p50, avro_rt.p50),
        "memcpy": {
            "fresh_buffer": copy_fresh.to_json(),
            "preallocated": copy_prealloc.to_json(),
            "fresh_gb_s": sig(nbytes / copy_fresh.p50 / 1e9),
            "preallocated_gb_s": sig(nbytes / copy_prealloc.p50 / 1e9),
        },
        "tensor_view_only": view_only.to_json("us"),
        "decode_vs_memcpy_fresh": ratio(avro_dec.p50, copy_fresh.p50),
        "decode_vs_memcpy_preallocated": ratio(avro_dec.p50, copy_prealloc.p50),
    }


def run(*, quick: bool = False, out: Path | None = None) -> dict[str, Any]:
    """Time both codecs on the 1024x1024 item in fp32 and bf16 and return the report block."""
    repeat, warmup = (1, 0) if quick else (9, 1)
    event = rendered_1024()
    results = {
        "fp32": _bench_dtype(event, torch.float32, repeat, warmup),
        "bf16": _bench_dtype(event, torch.bfloat16, repeat, warmup),
    }
    worst_speedup = min(r["speedup_roundtrip"] for r in results.values())
    # Judged against the slower-looking of the two copies' times, i.e. the stricter baseline.
    worst_decode = max(
        max(r["decode_vs_memcpy_fresh"], r["decode_vs_memcpy_preallocated"])
        for r in results.values()
    )
    return {
        **results,
        "headroom": {
            "roundtrip_speedup": headroom(worst_speedup, MIN_SPEEDUP, higher_is_better=True),
            "decode_vs_memcpy": headroom(
                worst_decode, MAX_DECODE_VS_MEMCPY, higher_is_better=False
            ),
        },
        "speedup_roundtrip_min": worst_speedup,
        "decode_vs_memcpy_max": worst_decode,
        "budget": budget(
            "Avro encode+decode of an EncodeEvent vs vLLM's JSON/base64/msgpack path for the "
            "same item: >= 5x faster (p50 round trip, both dtypes); tensor decode (the whole "
            "EncodeEvent frame) within 2x of a plain memcpy of the same bytes (both into a "
            "fresh buffer and into a preallocated one; the worse ratio is judged)",
            min_speedup=MIN_SPEEDUP,
            max_decode_vs_memcpy=MAX_DECODE_VS_MEMCPY,
        ),
        "meets_budget": worst_speedup >= MIN_SPEEDUP and worst_decode <= MAX_DECODE_VS_MEMCPY,
    }
