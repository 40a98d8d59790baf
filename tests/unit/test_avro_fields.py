"""One home for each field: each `.avsc` record and its dataclass agree, and every field survives.

A field added to a dataclass and not to its schema (or the reverse) fails
``test_avsc_fields_match_dataclass_fields``. A field added to both but lost on the way (a leaf
converter that forgets it) fails ``test_every_field_round_trips``: the sample events are built from
the schemas, so every field of every record, new ones included, gets a non-default value, and the
optional ones are tried both set and None. ``avro_events.json`` pins the bytes on the wire.

Regenerate that golden file only for a deliberate wire change:
``PYTHONPATH=. python -m tests.unit.test_avro_fields``.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from fastavro import parse_schema

import schemas.types as types_module
from schemas.codec import AVRO_DIR, EVENT_SCHEMAS, Codec, get_codec, load_event_schema
from schemas.convert import SchemaMismatch, avro_name, build_converter
from schemas.tensors import DTYPES, tensor_to_record
from schemas.types import EVENT_TYPES, STATUSES, TensorRef

GOLDEN = Path(__file__).parent / "golden" / "avro_events.json"
TENSOR_DTYPES = sorted(DTYPES)
VARIANTS = ("optional-set", "optional-none")


def _walk(schema: Any) -> Iterator[dict[str, Any]]:
    """Every named type spelled out inside a parsed schema."""
    if isinstance(schema, list):
        for branch in schema:
            yield from _walk(branch)
    elif isinstance(schema, dict):
        if schema["type"] in ("record", "enum"):
            yield schema
        for f in schema.get("fields", ()):
            yield from _walk(f["type"])
        for key in ("items", "values"):
            if key in schema:
                yield from _walk(schema[key])


def _named_types() -> dict[str, dict[str, Any]]:
    named: dict[str, dict[str, Any]] = {}
    for path in sorted(AVRO_DIR.glob("*.avsc")):
        for t in _walk(load_event_schema(path.stem)):
            named[t["name"]] = t
    return named


NAMED = _named_types()
RECORDS = sorted(n for n, t in NAMED.items() if t["type"] == "record")


def _python_fields(record: str) -> list[str]:
    """Field names of the Python side of a record: its dataclass, or torch.Tensor's wire form."""
    if record == "epd.Tensor":
        return list(tensor_to_record(torch.zeros(1)))
    cls = getattr(types_module, record.removeprefix("epd."), None)
    assert cls is not None and dataclasses.is_dataclass(cls), f"no dataclass for {record}"
    return [f.name for f in dataclasses.fields(cls)]


@pytest.mark.parametrize("record", RECORDS)
def test_avsc_fields_match_dataclass_fields(record: str) -> None:
    avsc = {f["name"] for f in NAMED[record]["fields"]}
    py = set(_python_fields(record))
    assert sorted(avsc - py) == [], f"{record}: fields in the .avsc without a dataclass field"
    assert sorted(py - avsc) == [], f"{record}: dataclass fields missing from the .avsc"


def test_every_dataclass_has_a_schema() -> None:
    classes = [
        obj.__name__
        for obj in vars(types_module).values()
        if isinstance(obj, type)
        and dataclasses.is_dataclass(obj)
        and obj.__module__ == types_module.__name__
    ]
    assert sorted(c for c in classes if f"epd.{c}" not in NAMED) == []
    assert EVENT_SCHEMAS == tuple(avro_name(t) for t in EVENT_TYPES)


def test_enum_symbols_match_python_tables() -> None:
    assert set(NAMED["epd.DType"]["symbols"]) == set(DTYPES)
    # Symbols are appended to the schema (old indexes never move); STATUSES is in lifecycle order.
    assert set(NAMED["epd.RequestStatus"]["symbols"]) == set(STATUSES)


def _defaults(cls: type, avro_field: dict[str, Any]) -> list[Any]:
    """The values a field would take unset: its dataclass default and its Avro default."""
    out = [avro_field["default"]] if "default" in avro_field else []
    for f in dataclasses.fields(cls):
        if f.name == avro_field["name"]:
            if f.default is not dataclasses.MISSING:
                out.append(f.default)
            elif f.default_factory is not dataclasses.MISSING:
                out.append(f.default_factory())
    return out


class _Sampler:
    """Builds records from their schemas: every field set, each value unlike its defaults."""

    def __init__(self, optional_set: bool) -> None:
        self.optional_set = optional_set
        self.n = 0
        self.seen: set[str] = set()
        self.tensor_turn = False

    def value(self, schema: Any, avoid: list[Any]) -> Any:
        schema = NAMED.get(schema, schema) if isinstance(schema, str) else schema
        if isinstance(schema, list):
            return self._union(schema, avoid)
        kind = schema if isinstance(schema, str) else schema["type"]
        self.n += 1
        n = self.n
        scalars = {
            "string": f"s{n}",
            "int": 1000 + n,
            "long": 2**40 + n,  # past 32 bits, so a long read as an int would show
            "float": n + 0.5,  # exact in float32
            "double": n + 0.25,
            "bytes": bytes([n % 256, 0, 255]),
            "boolean": True not in avoid,
        }
        if kind in scalars:
            return scalars[kind]
        if kind == "enum":
            return next(s for s in reversed(schema["symbols"]) if s not in avoid)
        if kind == "array":
            items = schema["items"]
            nullable = isinstance(items, list) and "null" in items
            return [self.value(items, []), None if nullable else self.value(items, [])]
        if kind == "map":
            return {
                f"k{n}a": self.value(schema["values"], []),
                f"k{n}b": self.value(schema["values"], []),
            }
        assert kind == "record", kind
        return self.record(schema)

    def _union(self, branches: list[Any], avoid: list[Any]) -> Any:
        names = {b if isinstance(b, str) else b.get("name", b["type"]) for b in branches}
        if names == {"epd.Tensor", "epd.TensorRef"}:
            self.tensor_turn = not self.tensor_turn
            return self.value("epd.Tensor" if self.tensor_turn else "epd.TensorRef", avoid)
        assert "null" in names and len(branches) == 2, f"unexpected union {names}"
        if not self.optional_set:
            return None
        (inner,) = [b for b in branches if b != "null"]
        return self.value(inner, avoid)

    def record(self, schema: dict[str, Any]) -> Any:
        name = schema["name"]
        self.seen.add(name)
        if name == "epd.Tensor":
            dtype = DTYPES[TENSOR_DTYPES[self.n % len(TENSOR_DTYPES)]]
            return (torch.arange(6) + self.n).reshape(2, 3).to(dtype)
        cls = getattr(types_module, name.removeprefix("epd."))
        kwargs = {f["name"]: self.value(f["type"], _defaults(cls, f)) for f in schema["fields"]}
        if cls is TensorRef:  # size fields must agree with each other, or decode rejects them
            kwargs.update(dtype="float16", shape=[2, 3], nbytes=12)
        for field, v in kwargs.items():
            if v is not None:
                assert all(v != d for d in _defaults(cls, _field(schema, field))), (name, field)
        return cls(**kwargs)


def _field(schema: dict[str, Any], name: str) -> dict[str, Any]:
    return next(f for f in schema["fields"] if f["name"] == name)


def _sample(cls: type, variant: str) -> tuple[Any, _Sampler]:
    sampler = _Sampler(optional_set=variant == "optional-set")
    return sampler.record(get_codec().schema(avro_name(cls))), sampler


def _diff(a: Any, b: Any, path: str) -> list[str]:
    """Where ``b`` differs from ``a``, field by field (tensors by dtype, shape and values)."""
    if isinstance(a, torch.Tensor):
        same = (
            isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a, b)
        )
        return [] if same else [f"{path}: {a!r} != {b!r}"]
    if dataclasses.is_dataclass(a):
        if type(a) is not type(b):
            return [f"{path}: {type(a).__name__} != {type(b).__name__}"]
        return [
            d
            for f in dataclasses.fields(a)
            for d in _diff(getattr(a, f.name), getattr(b, f.name), f"{path}.{f.name}")
        ]
    if isinstance(a, dict):
        if not isinstance(b, dict) or a.keys() != b.keys():
            return [f"{path}: keys {a!r} != {b!r}"]
        return [d for k in a for d in _diff(a[k], b[k], f"{path}[{k!r}]")]
    if isinstance(a, list):
        if not isinstance(b, list) or len(a) != len(b):
            return [f"{path}: {a!r} != {b!r}"]
        return [
            d
            for i, (x, y) in enumerate(zip(a, b, strict=True))
            for d in _diff(x, y, f"{path}[{i}]")
        ]
    return [] if type(a) is type(b) and a == b else [f"{path}: {a!r} != {b!r}"]


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("cls", EVENT_TYPES, ids=lambda c: c.__name__)
def test_every_field_round_trips(cls: type, variant: str) -> None:
    event, _ = _sample(cls, variant)
    back: Any = get_codec().decode(get_codec().encode(event), cls)
    assert _diff(event, back, cls.__name__) == []


def test_every_record_is_reached_by_some_event() -> None:
    seen: set[str] = set()
    for cls in EVENT_TYPES:
        seen |= _sample(cls, "optional-set")[1].seen
    assert sorted(set(RECORDS) - seen) == []


def _golden_frames() -> dict[str, str]:
    codec = get_codec()
    return {
        f"{cls.__name__}/{variant}": codec.encode(_sample(cls, variant)[0]).hex()
        for cls in EVENT_TYPES
        for variant in VARIANTS
    }


def test_wire_bytes_are_pinned() -> None:
    golden = json.loads(GOLDEN.read_text())
    assert _golden_frames() == golden
    for key, frame in golden.items():
        cls = getattr(types_module, key.split("/")[0])
        expected, _ = _sample(cls, key.split("/")[1])
        assert _diff(expected, get_codec().decode(bytes.fromhex(frame), cls), key) == []


# --- drift is refused when the converters are built -------------------------------------------


@dataclasses.dataclass(slots=True)
class Inner:
    a: int
    b: list[str] | None = None


@dataclasses.dataclass(slots=True)
class Outer:
    x: str
    inner: Inner
    by_key: dict[str, Inner]


def _outer_schema() -> dict[str, Any]:
    inner = {
        "type": "record",
        "name": "Inner",
        "namespace": "epd",
        "fields": [
            {"name": "a", "type": "long"},
            {"name": "b", "type": ["null", {"type": "array", "items": "string"}], "default": None},
        ],
    }
    return {
        "type": "record",
        "name": "Outer",
        "namespace": "epd",
        "fields": [
            {"name": "x", "type": "string"},
            {"name": "inner", "type": inner},
            {"name": "by_key", "type": {"type": "map", "values": "epd.Inner"}},
        ],
    }


def test_builder_accepts_matching_definitions() -> None:
    conv = build_converter(Outer, parse_schema(_outer_schema()))
    obj = Outer("x", Inner(1, ["p"]), {"k": Inner(2)})
    rec = conv.to_avro(obj)
    assert rec == {"x": "x", "inner": {"a": 1, "b": ["p"]}, "by_key": {"k": {"a": 2, "b": None}}}
    assert conv.from_avro(rec) == obj


def _mutated(edit: Any) -> dict[str, Any]:
    schema = _outer_schema()
    edit(schema)
    return schema


@pytest.mark.parametrize(
    ("schema", "message"),
    [
        (
            _mutated(lambda s: s["fields"].append({"name": "y", "type": "string", "default": ""})),
            r"only in the Avro schema \['y'\]",
        ),
        (_mutated(lambda s: s["fields"].pop()), r"only in the dataclass \['by_key'\]"),
        (
            _mutated(lambda s: s["fields"][2].update(type={"type": "array", "items": "epd.Inner"})),
            r"Outer\.by_key: Avro array needs a list",
        ),
        (
            _mutated(
                lambda s: s["fields"][1]["type"]["fields"][1].update(type="string", default="")
            ),
            r"Inner\.b: Avro string needs a str hint",
        ),
        (
            _mutated(lambda s: s["fields"][0].update(type=["null", "string"])),
            r"Outer\.x: .* is nullable, the hint",
        ),
        (
            _mutated(lambda s: s["fields"][0].update(type="long")),
            r"Outer\.x: Avro long needs a int",
        ),
        (_mutated(lambda s: s.update(name="Other")), r"Outer cannot hold record epd\.Other"),
    ],
)
def test_builder_refuses_drift(schema: dict[str, Any], message: str) -> None:
    with pytest.raises(SchemaMismatch, match=message):
        build_converter(Outer, parse_schema(schema))


@dataclasses.dataclass(slots=True)
class Computed:
    a: int
    b: int = dataclasses.field(init=False, default=0)


def test_builder_refuses_fields_it_cannot_pass_positionally() -> None:
    schema = {
        "type": "record",
        "name": "Computed",
        "namespace": "epd",
        "fields": [{"name": "a", "type": "long"}, {"name": "b", "type": "long"}],
    }
    with pytest.raises(SchemaMismatch, match=r"Computed: fields \['b'\] are not plain"):
        build_converter(Computed, parse_schema(schema))


def test_codec_refuses_a_schema_field_the_dataclass_lacks(tmp_path: Path) -> None:
    avro = tmp_path / "avro"
    shutil.copytree(AVRO_DIR, avro)
    error_info = json.loads((avro / "epd.ErrorInfo.avsc").read_text())
    error_info["fields"].append(
        {"name": "only_in_avsc", "type": ["null", "string"], "default": None}
    )
    (avro / "epd.ErrorInfo.avsc").write_text(json.dumps(error_info))
    with pytest.raises(
        SchemaMismatch, match=r"ErrorInfo.*only in the Avro schema \[.only_in_avsc.\]"
    ):
        Codec(avro_dir=avro, frozen_dir=tmp_path / "none")


def test_generated_source_is_readable() -> None:
    conv = build_converter(Outer, parse_schema(copy.deepcopy(_outer_schema())))
    assert "def _to_Outer(obj):" in conv.source and "def _from_Inner(rec):" in conv.source


if __name__ == "__main__":
    GOLDEN.write_text(json.dumps(_golden_frames(), indent=1, sort_keys=True) + "\n")
    print(f"wrote {GOLDEN}")
