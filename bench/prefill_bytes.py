"""Prefill-path bytes per request: our metadata-only PrefillEvent vs shipping full kwargs_data.

One 1024x1024 image through Qwen2-VL's processor (grid 1x74x74: 5476 patches x 1176 fp32 values,
25.8 MB of ``pixel_values``; ``image_grid_thw`` is 24 bytes). The fan-out (``FanOut.plan`` on a
``local://`` store) builds the PrefillEvent we send; it is framed with ``schemas.codec``. The
baselines carry the same request with the full processor output:

- ``avro_full``: our Avro PrefillEvent with ``kwargs_data`` filled in;
- ``vllm_json_full``: vLLM's ``GenerateRequest`` JSON body (base64 msgpack items, compact
  separators) with ``kwargs_data``, as its scale-out path ships it to prefill;
- ``vllm_json_metadata_only``: vLLM's own metadata-only body (``mm_metadata`` +
  ``ec_transfer_params``), for reference.

Sizes are deterministic, so nothing is repeated; the render time is reported for context.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import uuid
from pathlib import Path
from typing import Any

import torch

from bench.common import budget, headroom, ratio, render_info, rendered_1024

BUDGET_RATIO = 10_000.0
BYTE_VOCAB = 256
QWEN2_SPECIAL_BASE = 151643
"""Qwen2-VL's id of ``<|endoftext|>``, the first special token (``<|image_pad|>`` is 151655)."""


def _vllm_body(event: Any, features: Any, ec_params: dict[str, Any] | None) -> bytes:
    from schemas.vllm_wire import GenerateRequest, generate_request_to_json

    req = GenerateRequest(
        token_ids=list(event.token_ids),
        features=features,
        sampling_params={"max_tokens": event.sampling.max_tokens, "temperature": 0.0},
        request_id=event.request_id,
        model=event.model,
        ec_transfer_params=ec_params,
    )
    return json.dumps(generate_request_to_json(req), separators=(",", ":")).encode()


def _ec_json(prefill: Any) -> dict[str, Any]:
    return {
        h: {
            "mm_hash": e.mm_hash,
            "store": e.store,
            "key": e.key,
            "expires_ms": e.expires_ms,
            "signature": e.signature,
        }
        for h, e in prefill.ec_transfer_params.items()
    }


async def _plan(event: Any) -> Any:
    from producers.fanout import FanOut
    from runtime.settings import Settings
    from runtime.stores.local import LocalStore

    settings = Settings(ec_secret="bench-secret")  # signed entries, as in production
    store = LocalStore(f"local://bench-prefill-{uuid.uuid4().hex[:8]}")
    try:
        plan = await FanOut(settings, store, render_info()).plan(event)
        # The claim-checked pixel_values the plan parked; drop them again.
        for enc in plan.encode:
            for ref in enc.data.values():
                key = getattr(ref, "key", None)
                if key:
                    await store.delete(key)
        return plan
    finally:
        await store.close()


def _with_dtype(features: Any, dtype: torch.dtype) -> Any:
    """Features whose floating-point encoder inputs are cast to ``dtype``."""
    kw = {
        m: [
            None
            if it is None
            else {k: v.to(dtype) if v.is_floating_point() else v for k, v in it.items()}
            for it in items
        ]
        for m, items in (features.kwargs_data or {}).items()
    }
    return dataclasses.replace(features, kwargs_data=kw)


def qwen2vl_ids(token_ids: list[int]) -> list[int]:
    """Token ids with the tiny tokenizer's special tokens moved to their Qwen2-VL ids.

    The tiny byte tokenizer numbers ``<|image_pad|>`` 268; Qwen2-VL numbers it 151655. Avro
    writes ints as zigzag varints, so the real id costs 3 bytes instead of 2, and the image's
    1369 pad tokens dominate the prefill event. Byte ids (the prompt text) are left as they are.
    """
    return [QWEN2_SPECIAL_BASE + (t - BYTE_VOCAB) if t >= BYTE_VOCAB else t for t in token_ids]


CODECS = {"none": 0, "gzip": 1, "snappy": 2, "lz4": 3, "zstd": 4}


def record_batch_bytes(key: bytes, value: bytes, compression: str) -> int:
    """Bytes of a one-record Kafka batch as the producer sends it and the broker stores it."""
    from aiokafka.record.default_records import DefaultRecordBatchBuilder

    builder = DefaultRecordBatchBuilder(2, CODECS[compression], 0, -1, -1, -1, 64 * 1024 * 1024)
    builder.append(0, 0, key, value, [("epd-schema", b"epd.PrefillEvent")])
    return len(builder.build())


def _sizes(event: Any, prefill: Any) -> dict[str, Any]:
    """Our prefill event's bytes and both baselines' bytes, for one set of token ids."""
    from runtime.settings import Settings
    from schemas.codec import get_codec

    codec = get_codec()
    compression = Settings().prefill_compression
    key = prefill.request_id.encode()
    value = codec.encode(prefill)
    # Judged on the wire: the record batch the fan-out's prefill producer sends (compressed with
    # EPD_PREFILL_COMPRESSION), against the baselines' uncompressed bytes.
    ours = record_batch_bytes(key, value, compression)
    f = event.features
    pv = f.kwargs_data["image"][0]["pixel_values"]
    out: dict[str, Any] = {
        "ours_prefill_event_bytes": len(value),
        "ours_prefill_record_batch_bytes": ours,
        "prefill_compression": compression,
        "ours_prefill_record_batch_uncompressed_bytes": record_batch_bytes(key, value, "none"),
    }
    for label, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        full = _with_dtype(f, dtype)
        avro_full = len(codec.encode(dataclasses.replace(prefill, features=full)))
        vllm_full = len(_vllm_body(event, full, None))
        out[label] = {
            "pixel_values_bytes": pv.numel() * torch.empty((), dtype=dtype).element_size(),
            "avro_full_kwargs_bytes": avro_full,
            "vllm_json_full_kwargs_bytes": vllm_full,
            "ratio_vs_avro_full": ratio(avro_full, ours),
            "ratio_vs_vllm_json_full": ratio(vllm_full, ours),
        }
    return out


def _mm_payload_bytes(prefill: Any) -> int:
    """Bytes the multimodal part adds to our event (event minus the same event with no items)."""
    from schemas.codec import get_codec
    from schemas.types import Features

    bare = dataclasses.replace(
        prefill, features=Features({}, {}, None, None), ec_transfer_params={}
    )
    codec = get_codec()
    return len(codec.encode(prefill)) - len(codec.encode(bare))


def run(*, quick: bool = False, out: Path | None = None) -> dict[str, Any]:
    """Measure the byte sizes and return the report block (sizes are exact: no repeats)."""
    from schemas.types import Features

    event = rendered_1024()
    plan = asyncio.run(_plan(event))
    prefill = plan.prefill
    f = event.features
    item = f.kwargs_data["image"][0]
    pv, grid = item["pixel_values"], item["image_grid_thw"]

    as_rendered = _sizes(event, prefill)
    real_ids = qwen2vl_ids(list(event.token_ids))
    with_real_ids = _sizes(
        dataclasses.replace(event, token_ids=real_ids),
        dataclasses.replace(prefill, token_ids=real_ids),
    )
    vllm_meta = len(
        _vllm_body(
            event,
            Features(f.mm_hashes, f.mm_placeholders, None, f.mm_metadata),
            _ec_json(prefill),
        )
    )
    mm_payload = _mm_payload_bytes(prefill)
    # Judged on what a real Qwen2-VL deployment would send: the processor's fp32 output and
    # Qwen2-VL's token ids, against both baselines.
    judged = with_real_ids["fp32"]
    meets = (
        judged["ratio_vs_avro_full"] >= BUDGET_RATIO
        and judged["ratio_vs_vllm_json_full"] >= BUDGET_RATIO
    )
    return {
        "image": {
            "size": [1024, 1024],
            "grid_thw": [int(x) for x in grid.reshape(-1).tolist()],
            "pixel_values_shape": list(pv.shape),
            "pixel_values_dtype": str(pv.dtype).removeprefix("torch."),
            "image_grid_thw_bytes": grid.numel() * grid.element_size(),
            "token_ids": len(event.token_ids),
            "image_pad_tokens": f.mm_placeholders["image"][0].length,
        },
        "ours_encode_events": len(plan.encode),
        "tiny_tokenizer_ids": as_rendered,
        "qwen2vl_ids": with_real_ids,
        "vllm_json_metadata_only_bytes": vllm_meta,
        "mm_payload": {
            "ours_bytes": mm_payload,
            "full_kwargs_fp32_bytes": pv.numel() * pv.element_size() + grid.numel() * 8,
            "ratio": ratio(pv.numel() * pv.element_size() + grid.numel() * 8, mm_payload),
            "note": "multimodal part only (hashes, placeholder, grid, signed ec entry) vs the "
            "raw kwargs_data tensors; token ids excluded",
        },
        "headroom": {
            "vs_avro_full": headroom(
                judged["ratio_vs_avro_full"], BUDGET_RATIO, higher_is_better=True
            ),
            "vs_vllm_json_full": headroom(
                judged["ratio_vs_vllm_json_full"], BUDGET_RATIO, higher_is_better=True
            ),
        },
        "ratio_vs_avro_full": judged["ratio_vs_avro_full"],
        "ratio_vs_vllm_json_full": judged["ratio_vs_vllm_json_full"],
        "budget": budget(
            "Prefill-path bytes per request vs shipping full kwargs_data: >= 10,000x smaller "
            "for a 1024x1024 image (judged on the prefill record batch as sent, with "
            "EPD_PREFILL_COMPRESSION, fp32 pixel_values and Qwen2-VL token ids, against both "
            "baselines' uncompressed bytes)",
            min_ratio=BUDGET_RATIO,
        ),
        "meets_budget": meets,
    }
