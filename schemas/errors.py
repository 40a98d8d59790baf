"""Typed errors raised at the schema boundary."""

from __future__ import annotations


class CodecError(ValueError):
    """Bytes that cannot be decoded into an event, or an event that cannot be encoded."""


class ComputeError(ValueError):
    """Inputs the model cannot take (shape, grid or placeholder mismatch). Permanent: the same
    inputs fail the same way on every try."""


class ValidationError(ValueError):
    """An event or request that breaks a validation rule.

    Every rejection names the rule, and where it applies the modality, the item index and the
    field, so an operator can find the offending item without reading the payload.
    """

    def __init__(
        self,
        rule: str,
        message: str,
        *,
        modality: str | None = None,
        item: int | None = None,
        field: str | None = None,
    ) -> None:
        self.rule = rule
        self.modality = modality
        self.item = item
        self.field = field
        self.detail = message
        where = []
        if modality is not None:
            where.append(f"modality={modality!r}")
        if item is not None:
            where.append(f"item={item}")
        if field is not None:
            where.append(f"field={field!r}")
        loc = f" [{', '.join(where)}]" if where else ""
        super().__init__(f"{rule}: {message}{loc}")
