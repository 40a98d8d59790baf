"""The bounds a request model's fields document, declared beside the fields and written into
their JSON schema from the :class:`~runtime.request_limits.RequestLimits` the routes check.

A field says what it is bounded by (``prompt: Annotated[str | None, Bounds(maxLength=
LIMIT.max_prompt_chars)]``); :func:`bounded_schema` makes the model's JSON schema with the
values of this server's limits, so ``/openapi.json`` documents the limits the server has,
whatever the settings say. The bounds are documentation only: pydantic does not check them
(the routes check each through ``RequestLimits``, so a refusal keeps that rule's slug and
message, never pydantic's).

Each keyword goes to the branches of a nullable or union field that it applies to (``maxLength``
to the string, ``maxItems`` and ``items`` to the array, ``minimum`` to the number...), as JSON
Schema reads it; ``description`` replaces the field's own.
"""

from __future__ import annotations

import copy
import typing
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from runtime.request_limits import RequestLimits
from runtime.sampling_limits import INT32_MAX, MAX_TEMPERATURE

REF_TEMPLATE = "#/components/schemas/{model}"


@dataclass(frozen=True, slots=True)
class DocContext:
    """What a documented bound can name: the server's limits and the served model."""

    limits: RequestLimits
    model: str | None = None


@dataclass(frozen=True, slots=True)
class Ref:
    """A value of the :class:`DocContext` (None: the keyword is left out)."""

    get: Callable[[DocContext], Any]

    def __sub__(self, n: int) -> Ref:
        return Ref(lambda ctx: self.get(ctx) - n)


class _Limits:
    """``LIMIT.max_prompt_chars``: that limit of the server, as a :class:`Ref`."""

    def __getattr__(self, name: str) -> Ref:
        return Ref(lambda ctx: getattr(ctx.limits, name))


LIMIT = _Limits()
SERVED_MODEL = Ref(lambda ctx: None if ctx.model is None else [ctx.model])
"""For ``enum``: the one model name the server takes (left out when not known)."""


class Bounds:
    """JSON-schema keywords a field documents (values: constants, :class:`Ref`s, or dicts and
    lists of them)."""

    __slots__ = ("keywords",)

    def __init__(self, **keywords: Any) -> None:
        self.keywords = keywords

    def __repr__(self) -> str:
        return f"Bounds({', '.join(self.keywords)})"


class NeutralOnly:
    """A field documented as its accepted values only (``table[name]``): what it may be set
    to, not what it is typed as."""

    __slots__ = ("table",)

    def __init__(self, table: dict[str, tuple[Any, ...]]) -> None:
        self.table = table


NEUTRAL_NOTE = "accepted at its neutral value only (not supported)"

TYPED: dict[str, frozenset[str]] = {
    "number": frozenset({"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"}),
    "string": frozenset({"minLength", "maxLength", "pattern"}),
    "array": frozenset({"minItems", "maxItems", "items"}),
    "object": frozenset({"maxProperties", "propertyNames", "additionalProperties"}),
}
TYPED["integer"] = TYPED["number"]
"""The keywords each JSON type reads (a keyword of none of them applies to every branch)."""
_ALL_TYPED = frozenset().union(*TYPED.values())


def _resolve(value: Any, ctx: DocContext) -> Any:
    if isinstance(value, Ref):
        return value.get(ctx)
    if isinstance(value, dict):
        return {k: _resolve(v, ctx) for k, v in value.items()}
    if isinstance(value, list):
        return [_resolve(v, ctx) for v in value]
    return value


def bound(prop: dict[str, Any], **bounds: Any) -> None:
    """Add ``bounds`` to a property schema: each to the non-null branches it applies to
    (module docstring), ``description`` to the property itself."""
    if "description" in bounds:
        prop["description"] = bounds.pop("description")
    branches = [b for b in prop.get("anyOf", []) if b.get("type") != "null"] or [prop]
    for key, value in bounds.items():
        for branch in branches:
            kind = branch.get("type")
            if key not in _ALL_TYPED or kind not in TYPED or key in TYPED[kind]:
                branch[key] = copy.deepcopy(value)


def _models_in(annotation: Any) -> Iterator[type[BaseModel]]:
    """The pydantic models an annotation holds (``X | None``, ``list[X]``, ``Annotated``...)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        yield annotation
    for arg in typing.get_args(annotation):
        yield from _models_in(arg)


def _document_fields(
    model: type[BaseModel], props: dict[str, Any], ctx: DocContext, *, top: bool = True
) -> None:
    for name, info in model.model_fields.items():
        if name not in props:
            continue
        for marker in info.metadata:
            if isinstance(marker, Bounds):
                keywords = _resolve(marker.keywords, ctx)
                bound(props[name], **{k: v for k, v in keywords.items() if v is not None})
            elif isinstance(marker, NeutralOnly) and top and name in marker.table:
                props[name] = {"enum": list(marker.table[name]), "description": NEUTRAL_NOTE}


def bounded_schema(model: type[BaseModel], ctx: DocContext) -> dict[str, Any]:
    """``model``'s JSON schema with the bounds its fields (and those of the models it holds)
    declare, as ``ctx`` says them; ``$ref``s point into ``components/schemas``."""
    schema = model.model_json_schema(ref_template=REF_TEMPLATE)
    _document_fields(model, schema.get("properties", {}), ctx)
    defs = schema.get("$defs", {})
    seen: set[type[BaseModel]] = {model}
    stack = [model]
    while stack:
        for info in stack.pop().model_fields.values():
            for sub in _models_in(info.annotation):
                if sub not in seen:
                    seen.add(sub)
                    stack.append(sub)
                    if sub.__name__ in defs:
                        props = defs[sub.__name__].get("properties", {})
                        _document_fields(sub, props, ctx, top=False)
    return schema


# The bounds the sampling fields of every submit route share (RequestLimits.check_sampling).
MAX_TOKENS = Bounds(minimum=1, maximum=LIMIT.max_tokens)
TEMPERATURE = Bounds(minimum=0, maximum=MAX_TEMPERATURE)
TOP_P = Bounds(exclusiveMinimum=0, maximum=1)
TOP_K = Bounds(minimum=-1, maximum=INT32_MAX)
SEED = Bounds(minimum=-(2**63), maximum=2**63 - 1)
STOP = Bounds(
    minLength=1,
    maxLength=LIMIT.max_stop_string_chars,
    maxItems=LIMIT.max_stop_strings,
    items={"type": "string", "minLength": 1, "maxLength": LIMIT.max_stop_string_chars},
)
TOKEN_ID = {"type": "integer", "minimum": 0, "maximum": LIMIT.vocab_size - 1}
STOP_TOKEN_IDS = Bounds(maxItems=LIMIT.max_stop_token_ids, items=TOKEN_ID)
PROMPT_TOKEN_IDS = Bounds(maxItems=LIMIT.context_tokens - 1, items=TOKEN_ID)
CACHE_SALT = Bounds(maxLength=LIMIT.max_cache_salt_chars)
METADATA = Bounds(
    maxProperties=LIMIT.max_metadata_keys,
    propertyNames={"maxLength": LIMIT.max_metadata_chars},
    additionalProperties={"type": "string", "maxLength": LIMIT.max_metadata_chars},
)


def json_body(model: type[BaseModel]) -> dict[str, Any]:
    """An ``openapi_extra`` request body of ``model`` (the route reads the body itself), with
    the model's first example; :func:`bounded_schema` writes the bounds in when the document
    is made."""
    extra: Any = model.model_config.get("json_schema_extra")
    examples: list[Any] = extra.get("examples", []) if isinstance(extra, dict) else []
    content: dict[str, Any] = {"schema": model.model_json_schema(ref_template=REF_TEMPLATE)}
    if examples:
        content["example"] = examples[0]
    return {"required": True, "content": {"application/json": content}}


def hoist_defs(schema: dict[str, Any]) -> None:
    """Copy the ``$defs`` of schemas written inside operations (request bodies, event-stream
    chunks) into ``components/schemas``, where their ``$ref``s point."""
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    stack: list[Any] = [schema.get("paths", {})]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            for name, sub in (node.get("$defs") or {}).items():
                if name not in components:
                    components[name] = copy.deepcopy(sub)
            stack.extend(v for k, v in node.items() if k != "$defs")
        elif isinstance(node, list):
            stack.extend(node)
