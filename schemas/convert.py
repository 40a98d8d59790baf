"""Event dataclasses <-> Avro-shaped dicts (what fastavro reads and writes), derived, not mirrored.

Each record is defined twice on purpose: as a dataclass in ``schemas/types.py`` (what code
handles) and as an ``.avsc`` file in ``schemas/avro`` (what the wire carries). The converters
between them are not a third copy: :func:`build_converter` walks the dataclass's resolved type
hints and the parsed Avro schema side by side, once, and where the two disagree (a field in one
and not the other, a list where the schema has a map, an optional field whose schema cannot be
null) raises :class:`SchemaMismatch` naming the record and field, so drift fails when the codec
is built instead of dropping a field on the wire.

The walk emits Python source for one ``to``/``from`` function pair per record, compiled once, the
way ``dataclasses`` builds ``__init__``: a converted event costs what a hand-written converter
costs (field access, comprehensions, one call per nested record), with no per-call reflection.

Supported pairs (type hint <-> Avro type): ``str`` <-> string or enum, ``int`` <-> int or long,
``float`` <-> float or double, ``bool`` <-> boolean, ``bytes`` <-> bytes, ``list[X]`` <-> array,
``dict[str, X]`` <-> map, ``X | None`` <-> ``["null", X]``, a dataclass ``C`` <-> record
``epd.C``, and the tensor leaves from ``schemas.tensors``: ``Tensor`` <-> ``epd.Tensor`` and
``Tensor | TensorRef`` <-> ``[epd.Tensor, epd.TensorRef]`` (``schemas.types.Tensor``: the hints'
name for ``torch.Tensor``).

Building the converters imports no torch: a tensor leaf imports its module when it converts its
first value (a tensor or a claim check), so a process whose events carry none (the results
collector, dead letters) never loads torch, and one whose events do pays for it once. Encoding
goes through :mod:`schemas.tensor_codec` (torch-free; it hands torch tensors on to
:mod:`schemas.tensors`); decoding makes torch tensors (``tensors="torch"``) or, for a process
that holds no torch (``tensors="wire"``: the render router),
:class:`schemas.wire_tensor.WireTensor`.
"""

from __future__ import annotations

import dataclasses
import importlib
import keyword
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from schemas.types import Tensor, TensorRef

NAMESPACE = "epd"

_PRIMITIVES: dict[str, type] = {
    "string": str,
    "int": int,
    "long": int,
    "float": float,
    "double": float,
    "boolean": bool,
    "bytes": bytes,
}
_TENSOR_UNION = frozenset({f"{NAMESPACE}.Tensor", f"{NAMESPACE}.TensorRef"})

TensorForm = Literal["torch", "wire"]
"""What decoded tensors are: ``torch.Tensor`` or :class:`schemas.wire_tensor.WireTensor`."""

_TO_LEAVES = "schemas.tensor_codec"
# By form: the (module, function) decoding a ``Tensor | TensorRef`` value, then an ``epd.Tensor``.
_FROM_LEAVES: dict[str, tuple[tuple[str, str], tuple[str, str]]] = {
    "torch": (
        ("schemas.tensor_codec", "value_from_avro"),
        ("schemas.tensors", "tensor_from_record"),
    ),
    "wire": (
        ("schemas.tensor_codec", "wire_value_from_avro"),
        ("schemas.tensor_codec", "wire_tensor_from_record"),
    ),
}

Expr = Callable[[str], str] | None
"""Turns the source of an input expression into the source of its converted value; ``None``
means the value passes through unchanged."""


class SchemaMismatch(Exception):
    """A dataclass and its Avro schema disagree; the message names the record and field."""


@dataclass(frozen=True, slots=True)
class RecordConverter:
    """Both directions for one record type, built once by :func:`build_converter`."""

    name: str
    """Full Avro name, e.g. ``epd.PrefillEvent``."""
    to_avro: Callable[[Any], dict[str, Any]]
    from_avro: Callable[[dict[str, Any]], Any]
    source: str
    """The generated functions, for reading when a conversion surprises you."""


def avro_name(cls: type) -> str:
    """Full Avro record name for a dataclass: the class name in the ``epd`` namespace."""
    return f"{NAMESPACE}.{cls.__name__}"


def build_converter(cls: type, schema: Any, tensors: TensorForm = "torch") -> RecordConverter:
    """Converters between dataclass ``cls`` and its parsed Avro record ``schema``.

    ``schema`` is fastavro's parsed form (``load_schema`` / ``parse_schema``): full names, and a
    named type spelled out at its first use and referenced by name after that. ``tensors``: the
    form decoded tensors take (see the module docstring).
    """
    named: dict[str, Any] = {}
    _collect_named(schema, named)
    gen = _Generator(named, _FROM_LEAVES[tensors])
    to_fn, from_fn = gen.record(schema, cls, cls.__name__)
    source = "\n".join(gen.lines)
    # Compiled from text this module wrote from field names (identifiers, per Avro and Python),
    # never from event data.
    exec(compile(source, f"<epd converters for {schema['name']}>", "exec"), gen.namespace)
    return RecordConverter(schema["name"], gen.namespace[to_fn], gen.namespace[from_fn], source)


def _collect_named(schema: Any, named: dict[str, Any]) -> None:
    """Index every named type defined anywhere in ``schema`` by its full name."""
    if isinstance(schema, list):
        for branch in schema:
            _collect_named(branch, named)
    elif isinstance(schema, dict):
        if schema.get("type") in ("record", "error", "enum", "fixed"):
            named[schema["name"]] = schema
        for f in schema.get("fields", ()):
            _collect_named(f["type"], named)
        for key in ("items", "values"):
            if key in schema:
                _collect_named(schema[key], named)


def _as_list(v: Any) -> Any:
    # fastavro writes any sequence as an array, but a tuple inside a union would be taken as
    # its (branch, value) notation; a list is always safe and costs nothing when it is one.
    return v if type(v) is list else list(v)


def _is_union(hint: Any) -> bool:
    return typing.get_origin(hint) in (typing.Union, types.UnionType)


class _Generator:
    """Walks one parsed schema with the matching type hints, writing converter source."""

    def __init__(
        self, named: dict[str, Any], from_leaves: tuple[tuple[str, str], tuple[str, str]]
    ) -> None:
        self._named = named
        self._from_leaves = from_leaves
        self.namespace: dict[str, Any] = {"_as_list": _as_list}
        self.lines: list[str] = []
        self._records: dict[tuple[str, type], tuple[str, str]] = {}
        self._building: set[str] = set()
        self._vars = 0

    def _ref(self, obj: Any, stem: str) -> str:
        """A name in the generated module's namespace bound to ``obj``."""
        name = f"_{stem}_{len(self.namespace)}"
        self.namespace[name] = obj
        return name

    def _var(self) -> str:
        self._vars += 1
        return f"v{self._vars}"

    def _call(self, fn: Callable[[Any], Any], stem: str) -> Expr:
        name = self._ref(fn, stem)
        return lambda src: f"{name}({src})"

    def _tensor_leaf(self, module: str, attr: str) -> Expr:
        """A call of ``<module>.<attr>``, bound on its first call: the generated code reads the
        name from this namespace, so after the first value it calls the function itself (no
        indirection), and a process that never converts one never imports its module (torch,
        for :mod:`schemas.tensors`)."""
        namespace = self.namespace
        name = self._ref(None, attr)

        def first_call(value: Any) -> Any:
            # torch, for schemas.tensors: only the tensor union's values need it
            fn = namespace[name] = getattr(importlib.import_module(module), attr)
            return fn(value)

        namespace[name] = first_call
        return lambda src: f"{name}({src})"

    def _resolve(self, schema: Any) -> Any:
        if isinstance(schema, str) and schema not in _PRIMITIVES and schema != "null":
            try:
                return self._named[schema]
            except KeyError:
                raise SchemaMismatch(f"unknown Avro type {schema!r}") from None
        return schema

    def build(self, schema: Any, hint: Any, where: str) -> tuple[Expr, Expr]:
        """(to_avro, from_avro) for one value of Avro type ``schema`` and Python type ``hint``."""
        schema = self._resolve(schema)
        if isinstance(schema, list):
            return self._union(schema, hint, where)
        if isinstance(schema, dict) and "logicalType" in schema:
            raise SchemaMismatch(f"{where}: logical types are not supported ({schema})")
        kind = schema["type"] if isinstance(schema, dict) else schema
        if kind in _PRIMITIVES:
            return self._expect(hint, _PRIMITIVES[kind], kind, where)
        if kind == "enum":
            return self._expect(hint, str, f"enum {schema['name']}", where)
        if kind == "array":
            return self._array(schema, hint, where)
        if kind == "map":
            return self._map(schema, hint, where)
        if kind == "record":
            return self._nested_record(schema, hint, where)
        raise SchemaMismatch(f"{where}: Avro type {kind!r} is not supported")

    @staticmethod
    def _expect(hint: Any, py: type, avro: str, where: str) -> tuple[Expr, Expr]:
        if hint is not py:
            raise SchemaMismatch(f"{where}: Avro {avro} needs a {py.__name__} hint, not {hint}")
        return None, None

    def _array(self, schema: dict[str, Any], hint: Any, where: str) -> tuple[Expr, Expr]:
        if typing.get_origin(hint) is not list:
            raise SchemaMismatch(f"{where}: Avro array needs a list[...] hint, not {hint}")
        to, frm = self.build(schema["items"], typing.get_args(hint)[0], f"{where}[]")
        return (
            (lambda src: f"_as_list({src})") if to is None else self._each(to),
            None if frm is None else self._each(frm),
        )

    def _each(self, item: Callable[[str], str]) -> Expr:
        x = self._var()
        return lambda src: f"[{item(x)} for {x} in {src}]"

    def _map(self, schema: dict[str, Any], hint: Any, where: str) -> tuple[Expr, Expr]:
        args = typing.get_args(hint)
        if typing.get_origin(hint) is not dict or args[0] is not str:
            raise SchemaMismatch(f"{where}: Avro map needs a dict[str, ...] hint, not {hint}")
        to, frm = self.build(schema["values"], args[1], f"{where}{{}}")
        return self._each_value(to), self._each_value(frm)

    def _each_value(self, value: Expr) -> Expr:
        if value is None:
            return None
        k, x = self._var(), self._var()
        return lambda src: f"{{{k}: {value(x)} for {k}, {x} in {src}.items()}}"

    def _union(self, branches: list[Any], hint: Any, where: str) -> tuple[Expr, Expr]:
        names = {self._branch_name(b) for b in branches}
        hint_args = set(typing.get_args(hint)) if _is_union(hint) else {hint}
        if names == _TENSOR_UNION and hint_args == {Tensor, TensorRef}:
            # value_to_avro names the branch explicitly, so fastavro never has to guess it.
            return (
                self._tensor_leaf(_TO_LEAVES, "value_to_avro"),
                self._tensor_leaf(*self._from_leaves[0]),
            )
        if "null" in names and len(branches) == 2:
            if type(None) not in hint_args or len(hint_args) != 2:
                raise SchemaMismatch(f"{where}: Avro {branches} is nullable, the hint {hint} not")
            (inner,) = [b for b in branches if b != "null"]
            (inner_hint,) = hint_args - {type(None)}
            to, frm = self.build(inner, inner_hint, where)
            return self._optional(to), self._optional(frm)
        raise SchemaMismatch(
            f"{where}: no conversion for union {sorted(names)} with hint {hint}; supported: "
            "[null, X] as X | None, and [epd.Tensor, epd.TensorRef] as Tensor | TensorRef"
        )

    @staticmethod
    def _optional(inner: Expr) -> Expr:
        if inner is None:
            return None
        # src is a field access or a loop variable: cheap and side-effect free to read twice.
        return lambda src: f"(None if {src} is None else {inner(src)})"

    def _branch_name(self, branch: Any) -> str:
        resolved = self._resolve(branch)
        if isinstance(resolved, dict):
            return str(resolved.get("name", resolved["type"]))
        return str(resolved)

    def _nested_record(self, schema: dict[str, Any], hint: Any, where: str) -> tuple[Expr, Expr]:
        if hint is Tensor and schema["name"] == f"{NAMESPACE}.Tensor":
            return (
                self._tensor_leaf(_TO_LEAVES, "tensor_to_record"),
                self._tensor_leaf(*self._from_leaves[1]),
            )
        if not (isinstance(hint, type) and dataclasses.is_dataclass(hint)):
            raise SchemaMismatch(f"{where}: Avro record {schema['name']} needs a dataclass hint")
        to_fn, from_fn = self.record(schema, hint, where)
        return (lambda src: f"{to_fn}({src})"), (lambda src: f"{from_fn}({src})")

    def record(self, schema: dict[str, Any], cls: type, where: str) -> tuple[str, str]:
        """Write the record's to/from functions (once per record); returns their names."""
        name = schema["name"]
        if avro_name(cls) != name:
            raise SchemaMismatch(f"{where}: dataclass {cls.__name__} cannot hold record {name}")
        if (name, cls) in self._records:
            return self._records[(name, cls)]
        if name in self._building:
            raise SchemaMismatch(f"{where}: recursive record {name} is not supported")
        self._building.add(name)
        hints = typing.get_type_hints(cls)
        py_fields = [f.name for f in dataclasses.fields(cls)]
        avro_fields = {f["name"]: f["type"] for f in schema["fields"]}
        only_py = [f for f in py_fields if f not in avro_fields]
        only_avro = [f for f in avro_fields if f not in py_fields]
        if only_py or only_avro:
            raise SchemaMismatch(
                f"{cls.__name__} and {name} disagree: fields only in the dataclass {only_py}, "
                f"only in the Avro schema {only_avro}"
            )
        # The generated source reads fields as attributes and passes them positionally.
        bad = [
            f.name
            for f in dataclasses.fields(cls)
            if not f.init or f.kw_only or keyword.iskeyword(f.name) or not f.name.isidentifier()
        ]
        if bad:
            raise SchemaMismatch(f"{cls.__name__}: fields {bad} are not plain positional fields")
        exprs = {f: self.build(t, hints[f], f"{cls.__name__}.{f}") for f, t in avro_fields.items()}
        to_fn, from_fn = f"_to_{cls.__name__}", f"_from_{cls.__name__}"
        cls_ref = self._ref(cls, cls.__name__)
        to_items = [f"{f!r}: {_apply(exprs[f][0], f'obj.{f}')}" for f in avro_fields]
        # Positional arguments in dataclass order: cheaper than keywords, same result.
        from_args = [_apply(exprs[f][1], f"rec[{f!r}]") for f in py_fields]
        self.lines += [
            f"def {to_fn}(obj):",
            "    return {" + ", ".join(to_items) + "}",
            f"def {from_fn}(rec):",
            f"    return {cls_ref}(" + ", ".join(from_args) + ")",
        ]
        self._building.discard(name)
        self._records[(name, cls)] = (to_fn, from_fn)
        return to_fn, from_fn


def _apply(expr: Expr, src: str) -> str:
    return src if expr is None else expr(src)
