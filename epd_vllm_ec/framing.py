"""An encoder output as vLLM's encoder cache holds it, and as our store holds it.

vLLM keeps one tensor per item, ``(tokens, width)``. Our encode worker stores a model family
with one output (Qwen2-VL, Qwen2.5-VL) as that tensor itself, and Qwen3-VL as one multi-tensor
entry ``{"embeds": (tokens, hidden), "deepstack": (levels, tokens, hidden)}``
(:func:`gpu_workers.entries.store_outputs`), where vLLM concatenates the same features along the
width: ``[embeds | deepstack[0] | ... | deepstack[levels-1]]`` (``Qwen3_VisionTransformer``).
These functions turn one into the other, so both sides read what the other wrote.
"""

from __future__ import annotations

import torch

from runtime.stores.base import tensor_view, unpack_tensors
from schemas.families import DEEPSTACK, EMBEDS


class FramingError(ValueError):
    """A value that is not an encoder output this connector can hand over (wrong shape, too
    large, a multi-tensor entry without the expected members)."""


def nbytes(t: torch.Tensor) -> int:
    """The tensor's data size in bytes."""
    return t.numel() * t.element_size()


def store_value(
    output: torch.Tensor, deepstack_levels: int
) -> torch.Tensor | dict[str, torch.Tensor]:
    """What our encode worker would have stored for vLLM's ``output`` (on the CPU)."""
    if output.dim() != 2:
        raise FramingError(f"an encoder output is (tokens, width); got shape {list(output.shape)}")
    t = output.detach().cpu()
    if deepstack_levels == 0:
        return t
    tokens, width = t.shape
    if width % (deepstack_levels + 1):
        raise FramingError(
            f"width {width} does not split into 1 + {deepstack_levels} deepstack levels"
        )
    parts = t.reshape(tokens, deepstack_levels + 1, width // (deepstack_levels + 1))
    return {
        EMBEDS: parts[:, 0].contiguous(),
        DEEPSTACK: parts[:, 1:].permute(1, 0, 2).contiguous(),
    }


def vllm_output(value: torch.Tensor, key: str) -> torch.Tensor:
    """vLLM's encoder-cache tensor for a value read from our store under ``key``.

    A plain 2-D tensor is the output itself; a 1-D ``uint8`` value is a multi-tensor entry (an
    embedding is never 1-D bytes), whose digest :func:`unpack_tensors` checks."""
    if value.dim() == 2:
        return value
    if value.dtype != torch.uint8 or value.dim() != 1:
        raise FramingError(f"{key!r} holds shape {list(value.shape)}, not an encoder output")
    entry = unpack_tensors(tensor_view(value), key)
    embeds, deepstack = entry.get(EMBEDS), entry.get(DEEPSTACK)
    if embeds is None or embeds.dim() != 2 or set(entry) - {EMBEDS, DEEPSTACK}:
        raise FramingError(f"{key!r} holds members {sorted(entry)}, not an encoder output")
    if deepstack is None:
        return embeds
    if deepstack.dim() != 3 or deepstack.shape[1:] != embeds.shape:
        raise FramingError(
            f"{key!r}: deepstack {list(deepstack.shape)} does not match embeds {list(embeds.shape)}"
        )
    if deepstack.dtype != embeds.dtype:
        raise FramingError(f"{key!r}: deepstack is {deepstack.dtype}, embeds {embeds.dtype}")
    return torch.cat([embeds.unsqueeze(0), deepstack]).permute(1, 0, 2).reshape(embeds.shape[0], -1)


def check_loaded(output: torch.Tensor, key: str, rows: int | None, max_bytes: int) -> None:
    """Refuse an output of the wrong length for its placeholder, or over the size bound."""
    if nbytes(output) > max_bytes:
        raise FramingError(f"{key!r} holds {nbytes(output)} bytes, over max_item_bytes {max_bytes}")
    if rows is not None and output.shape[0] != rows:
        raise FramingError(
            f"{key!r} holds {output.shape[0]} embeddings, the request's placeholder needs {rows}"
        )
