"""Schema evolution: the current schemas must read data written with every frozen version."""

from __future__ import annotations

import copy
import io
from pathlib import Path
from typing import Any

import pytest
from fastavro import parse_schema, schemaless_reader, schemaless_writer
from fastavro.utils import generate_many

from schemas.codec import (
    AVRO_DIR,
    EVENT_SCHEMAS,
    FROZEN_DIR,
    MAGIC,
    fingerprint,
    get_codec,
    load_event_schema,
)

FROZEN_VERSIONS = sorted(p for p in FROZEN_DIR.iterdir() if p.is_dir())
FROZEN_PAIRS = [
    (version, name)
    for version in FROZEN_VERSIONS
    for name in EVENT_SCHEMAS
    if (version / f"{name}.avsc").exists()
]
"""Every (frozen version, event schema) pair: a version holds the events that existed then."""


def backward_incompatibilities(old: Any, new: Any, samples: int = 25) -> list[str]:
    """Problems reading data written with ``old`` using ``new`` as the reader schema."""
    problems = []
    for i, datum in enumerate(generate_many(old, samples)):
        buf = io.BytesIO()
        schemaless_writer(buf, old, datum)
        buf.seek(0)
        try:
            schemaless_reader(buf, old, new)
        except Exception as exc:
            problems.append(f"sample {i}: {type(exc).__name__}: {exc}")
    return problems


def test_every_event_schema_is_frozen() -> None:
    """The first release froze the first six events; each later event (DecodeEvent) is frozen
    from the version it came in, so a change to it is checked like the others'."""
    assert FROZEN_VERSIONS, "schemas/frozen must hold at least the first released version"
    first = {n for v, n in FROZEN_PAIRS if v == FROZEN_VERSIONS[0]}
    assert len(first) == 6 and "epd.DecodeEvent" not in first
    for name in EVENT_SCHEMAS:
        assert any(n == name for _, n in FROZEN_PAIRS), f"no frozen version holds {name}"
    for version in FROZEN_VERSIONS[1:]:
        for name in EVENT_SCHEMAS:
            if name in first:  # a later version holds every event the first did
                assert (version / f"{name}.avsc").exists(), f"{version.name} lacks {name}"


@pytest.mark.parametrize(
    ("version", "name"), FROZEN_PAIRS, ids=lambda p: p.name if isinstance(p, Path) else p
)
def test_current_reads_frozen(version: Path, name: str) -> None:
    old = load_event_schema(name, version)
    new = load_event_schema(name, AVRO_DIR)
    assert backward_incompatibilities(old, new) == []


@pytest.mark.parametrize("version", FROZEN_VERSIONS, ids=lambda p: p.name)
def test_codec_decodes_frames_written_with_frozen_schema(version: Path) -> None:
    old = load_event_schema("epd.ResultEvent", version)
    buf = io.BytesIO()
    buf.write(MAGIC + fingerprint(old))
    schemaless_writer(
        buf,
        old,
        {
            "request_id": "r-old",
            "stage": "api",
            "status": "queued",
            "token_ids": None,
            "text": None,
            "error": None,
            "timings": {},
            "info": {},
            "worker": "",
            "created_ms": 1,
        },
    )
    ev = get_codec().decode(buf.getvalue())
    assert ev.request_id == "r-old" and ev.status == "queued"


def _result_schema() -> dict[str, Any]:
    return copy.deepcopy(load_event_schema("epd.ResultEvent", AVRO_DIR))


def test_checker_catches_a_new_field_without_default() -> None:
    old = _result_schema()
    new = _result_schema()
    new["fields"].append({"name": "tenant", "type": "string"})
    assert backward_incompatibilities(parse_schema(old), parse_schema(new))


def test_checker_catches_a_type_change() -> None:
    old = _result_schema()
    new = _result_schema()
    for f in new["fields"]:
        if f["name"] == "created_ms":
            f["type"] = "string"
    assert backward_incompatibilities(parse_schema(old), parse_schema(new))


def test_checker_accepts_a_new_field_with_default() -> None:
    old = _result_schema()
    new = _result_schema()
    new["fields"].append({"name": "tenant", "type": ["null", "string"], "default": None})
    assert backward_incompatibilities(parse_schema(old), parse_schema(new)) == []


def test_a_prefill_event_written_before_sampling_decodes_with_the_defaults() -> None:
    """v1's SamplingParams had no top_p, top_k, seed or stop, and a float temperature: its
    events decode into today's type with the new fields at their defaults (greedy, no stops)."""
    version = FROZEN_DIR / "v1"
    old = load_event_schema("epd.PrefillEvent", version)
    old_fields = {f["name"] for f in old["fields"][5]["type"]["fields"]}
    assert old_fields == {"max_tokens", "temperature", "stop_token_ids", "ignore_eos"}
    buf = io.BytesIO()
    buf.write(MAGIC + fingerprint(old))
    schemaless_writer(
        buf,
        old,
        {
            "request_id": "r-v1",
            "model": "tiny",
            "token_ids": [1, 2, 3],
            "features": {
                "mm_hashes": {},
                "mm_placeholders": {},
                "kwargs_data": None,
                "mm_metadata": None,
            },
            "ec_transfer_params": {},
            "sampling": {
                "max_tokens": 7,
                "temperature": 0.0,
                "stop_token_ids": [5],
                "ignore_eos": True,
            },
            "cache_salt": None,
            "deadline_ms": None,
            "created_ms": 1,
            "trace": {},
        },
    )
    ev = get_codec().decode(buf.getvalue())
    s = ev.sampling
    assert (s.max_tokens, s.temperature, s.stop_token_ids, s.ignore_eos) == (7, 0.0, [5], True)
    assert (s.top_p, s.top_k, s.seed, s.stop) == (1.0, 0, None, [])
    assert s.greedy


def test_a_decode_event_written_with_its_frozen_schema_decodes() -> None:
    version = next(v for v, n in FROZEN_PAIRS if n == "epd.DecodeEvent")
    old = load_event_schema("epd.DecodeEvent", version)
    prefill = {
        "request_id": "r-dec",
        "model": "tiny",
        "token_ids": [1, 2, 3],
        "features": {
            "mm_hashes": {},
            "mm_placeholders": {},
            "kwargs_data": None,
            "mm_metadata": None,
        },
        "ec_transfer_params": {},
        "sampling": {
            "max_tokens": 4,
            "temperature": 0.7,
            "stop_token_ids": [],
            "ignore_eos": False,
            "top_p": 0.9,
            "top_k": 5,
            "seed": 3,
            "stop": ["END"],
        },
        "cache_salt": None,
        "deadline_ms": None,
        "created_ms": 1,
        "trace": {},
        "kv_transfer_params": '{"do_remote_decode": true}',
    }
    kv = {
        "store": "redis://127.0.0.1:6379/0",
        "key": "ec:kv:fp:r-dec",
        "expires_ms": 9,
        "layers": 2,
        "kv_heads": 2,
        "head_dim": 16,
        "dtype": "float32",
        "seq_len": 3,
        "next_position": [3, 3, 3],
        "nbytes": 768,
        "signature": "ab",
    }
    buf = io.BytesIO()
    buf.write(MAGIC + fingerprint(old))
    schemaless_writer(
        buf, old, {"prefill": prefill, "kv": kv, "kv_transfer_params": None, "created_ms": 2}
    )
    ev = get_codec().decode(buf.getvalue())
    assert ev.request_id == "r-dec" and ev.prefill.sampling.stop == ["END"]
    assert ev.kv is not None and ev.kv.next_position == [3, 3, 3]
