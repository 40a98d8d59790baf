"""Writing a limit into a JSON schema property (the one way ``/openapi.json`` documents a
bound), and the sampling fields' bounds every submit route shares."""

from __future__ import annotations

from typing import Any

from runtime.request_limits import RequestLimits
from runtime.sampling_limits import INT32_MAX, MAX_TEMPERATURE, MIN_TEMPERATURE


def bound(prop: dict[str, Any], **bounds: Any) -> None:
    """Add ``bounds`` to a property schema (to its non-null branch when it is nullable)."""
    branches = [b for b in prop.get("anyOf", []) if b.get("type") != "null"]
    for target in branches or [prop]:
        target.update(bounds)


def sampling_bounds(
    props: dict[str, Any],
    limits: RequestLimits,
    *,
    max_tokens: tuple[str, ...] = ("max_tokens",),
    stop_form: bool = False,
) -> None:
    """The sampling fields' bounds (those of ``props`` that exist), as
    :meth:`RequestLimits.check_sampling` checks them."""
    for name in max_tokens:
        if name in props:
            bound(props[name], minimum=1, maximum=limits.max_tokens)
    if "temperature" in props:
        bound(
            props["temperature"],
            minimum=0,
            maximum=MAX_TEMPERATURE,
            description=f"0: greedy; else at least {MIN_TEMPERATURE:g}: sampled (temperature, "
            "then top_k, then top_p, as transformers' warpers)",
        )
    if "top_p" in props:
        bound(props["top_p"], exclusiveMinimum=0, maximum=1)
    if "top_k" in props:
        bound(props["top_k"], minimum=-1, maximum=INT32_MAX)
    if "seed" in props:
        bound(props["seed"], minimum=-(2**63), maximum=2**63 - 1)
    if "stop" in props:
        one = {"type": "string", "minLength": 1, "maxLength": limits.max_stop_string_chars}
        many = {"type": "array", "maxItems": limits.max_stop_strings, "items": one}
        prop = props["stop"]
        if stop_form:
            prop.update(many)
        else:
            for branch in prop.get("anyOf", [prop]):
                if branch.get("type") == "string":
                    branch.update(one)
                elif branch.get("type") == "array":
                    branch.update(many)
    if "stop_token_ids" in props:
        for branch in props["stop_token_ids"].get("anyOf", [props["stop_token_ids"]]):
            if branch.get("type") == "array":
                branch["maxItems"] = limits.max_stop_token_ids
