"""Avro single-object encoding of events.

Frame: ``C3 01`` + 8-byte little-endian CRC-64-AVRO fingerprint of the writer schema's parsing
canonical form + the Avro binary datum. A reader finds the writer schema in a table built from
``schemas/avro`` (current) and ``schemas/frozen`` (past versions), then resolves it against the
current schema, so old events stay readable after a backward-compatible change.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any, TypeVar

from fastavro import schemaless_reader, schemaless_writer
from fastavro.schema import fingerprint as avro_fingerprint
from fastavro.schema import load_schema, to_parsing_canonical_form

from schemas.convert import RecordConverter, TensorForm, avro_name, build_converter
from schemas.errors import CodecError
from schemas.types import EVENT_TYPES, Event

MAGIC = b"\xc3\x01"
HEADER_LEN = 10
SCHEMA_HEADER = "epd-schema"
"""Kafka header carrying the full schema name, for tools that do not parse the frame."""

AVRO_DIR = Path(__file__).parent / "avro"
FROZEN_DIR = Path(__file__).parent / "frozen"
EVENT_SCHEMAS = tuple(avro_name(t) for t in EVENT_TYPES)
"""Full Avro names of the event records, one per type in ``schemas.types.EVENT_TYPES``."""


def fingerprint(parsed_schema: Any) -> bytes:
    """8-byte fingerprint of a parsed schema, as single-object encoding frames it: fastavro's
    CRC-64-AVRO of the parsing canonical form (its hex is the little-endian byte order the
    frame carries)."""
    canonical = to_parsing_canonical_form(parsed_schema)
    return bytes.fromhex(avro_fingerprint(canonical, "CRC-64-AVRO"))


@dataclass(frozen=True, slots=True)
class _Writer:
    name: str
    schema: Any  # parsed writer schema
    reader: Any | None  # parsed current schema when it differs from the writer's, else None


def load_event_schema(name: str, directory: Path = AVRO_DIR) -> Any:
    """Parse ``<directory>/<name>.avsc`` with its named types resolved from the same folder."""
    return load_schema(str(directory / f"{name}.avsc"), _write_hint=False)


class Codec:
    """Encodes event dataclasses to framed Avro and back. Immutable once built; share it freely."""

    def __init__(
        self,
        avro_dir: Path = AVRO_DIR,
        frozen_dir: Path = FROZEN_DIR,
        tensors: TensorForm = "torch",
    ) -> None:
        """``tensors``: what decoded tensors are, ``torch.Tensor`` or, for a process that
        imports no torch, :class:`schemas.wire_tensor.WireTensor` (either form encodes)."""
        self._current: dict[str, tuple[Any, bytes]] = {}
        self._writers: dict[bytes, _Writer] = {}
        # Converters are derived from each dataclass and its current schema here, once; a
        # dataclass that disagrees with its schema raises SchemaMismatch now, not mid-stream.
        self._by_type: dict[type, RecordConverter] = {}
        self._by_name: dict[str, RecordConverter] = {}
        for cls in EVENT_TYPES:
            name = avro_name(cls)
            parsed = load_event_schema(name, avro_dir)
            fp = fingerprint(parsed)
            self._current[name] = (parsed, fp)
            self._writers[fp] = _Writer(name, parsed, None)
            self._by_type[cls] = self._by_name[name] = build_converter(cls, parsed, tensors)
        if frozen_dir.is_dir():
            for version_dir in sorted(p for p in frozen_dir.iterdir() if p.is_dir()):
                for name in EVENT_SCHEMAS:
                    if not (version_dir / f"{name}.avsc").exists():
                        continue
                    parsed = load_event_schema(name, version_dir)
                    fp = fingerprint(parsed)
                    if fp not in self._writers:
                        self._writers[fp] = _Writer(name, parsed, self._current[name][0])

    @property
    def fingerprints(self) -> dict[bytes, str]:
        """Every known writer fingerprint and its schema name (current and frozen versions)."""
        return {fp: w.name for fp, w in self._writers.items()}

    def schema(self, name: str) -> Any:
        """The current parsed schema for an event name such as ``epd.PrefillEvent``."""
        return self._current[name][0]

    def schema_name(self, event: Event) -> str:
        """Full Avro name of an event's schema."""
        return self._converter(event).name

    def _converter(self, event: Event) -> RecordConverter:
        try:
            return self._by_type[type(event)]
        except KeyError:
            raise CodecError(f"not an event type: {type(event).__name__}") from None

    def encode(self, event: Event) -> bytes:
        """Frame and serialise one event."""
        conv = self._converter(event)
        name = conv.name
        parsed, fp = self._current[name]
        buf = io.BytesIO()
        buf.write(MAGIC)
        buf.write(fp)
        try:
            schemaless_writer(buf, parsed, conv.to_avro(event))
        except CodecError:
            raise
        except Exception as exc:  # fastavro raises assorted types for bad field values
            raise CodecError(f"cannot encode {name}: {exc}") from exc
        return buf.getvalue()

    def peek(self, data: bytes) -> str:
        """Schema name of a framed event without decoding the datum."""
        return self._writer_for(data).name

    def _writer_for(self, data: bytes | memoryview) -> _Writer:
        if len(data) < HEADER_LEN:
            raise CodecError(
                f"truncated frame: {len(data)} bytes, the header alone is {HEADER_LEN}"
            )
        if bytes(data[:2]) != MAGIC:
            raise CodecError(
                f"not an Avro single-object frame: magic {bytes(data[:2]).hex()} != c301"
            )
        fp = bytes(data[2:HEADER_LEN])
        writer = self._writers.get(fp)
        if writer is None:
            raise CodecError(f"unknown schema fingerprint {fp.hex()}")
        return writer

    def decode(self, data: bytes | memoryview, expect: type[E] | None = None) -> E:
        """Decode one framed event; ``expect`` checks its type. Raises CodecError, never hangs."""
        writer = self._writer_for(data)
        buf = io.BytesIO(data)
        buf.seek(HEADER_LEN)
        try:
            record = schemaless_reader(buf, writer.schema, writer.reader)
        except Exception as exc:  # truncated/corrupt datum: EOFError, ValueError, MemoryError...
            raise CodecError(f"corrupt {writer.name} datum: {type(exc).__name__}: {exc}") from exc
        if buf.tell() != len(data):
            raise CodecError(
                f"{writer.name}: {len(data) - buf.tell()} trailing bytes after the datum"
            )
        try:
            # A record always decodes to a dict; fastavro types the result as any datum.
            event = self._by_name[writer.name].from_avro(record)  # type: ignore[arg-type]
        except CodecError:
            raise
        except Exception as exc:
            raise CodecError(f"invalid {writer.name}: {type(exc).__name__}: {exc}") from exc
        if expect is not None and not isinstance(event, expect):
            raise CodecError(f"expected {expect.__name__}, got {writer.name}")
        return event  # type: ignore[return-value]


E = TypeVar("E")


@cache
def get_codec() -> Codec:
    """The process-wide codec (schemas parsed once)."""
    return Codec()


@cache
def wire_codec() -> Codec:
    """A process-wide codec whose decoded tensors are :class:`schemas.wire_tensor.WireTensor`
    (no torch): the render router's, which only checks, hashes and forwards them."""
    return Codec(tensors="wire")


def encode(event: Event) -> bytes:
    """Encode with the process-wide codec."""
    return get_codec().encode(event)


def decode(data: bytes | memoryview, expect: type[E] | None = None) -> E:
    """Decode with the process-wide codec."""
    return get_codec().decode(data, expect)


def canonical_schema_json(name: str) -> str:
    """Parsing canonical form of a current event schema (stable text for docs and tools)."""
    return to_parsing_canonical_form(get_codec().schema(name))


__all__ = [
    "MAGIC",
    "SCHEMA_HEADER",
    "Codec",
    "CodecError",
    "canonical_schema_json",
    "decode",
    "encode",
    "fingerprint",
    "get_codec",
    "wire_codec",
]
