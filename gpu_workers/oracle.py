"""The reference path: ``model.generate`` on raw pixels in one process, the oracle the split path
is checked against (the tests, ``epd verify``, ``bench/gpu.py``).

Parity contract: the split path (encoder outputs from ``encode_items``, encoded in any grouping,
-> :func:`gpu_workers.compute.prefill` -> :class:`gpu_workers.engine.DecodeEngine`, batched or
alone as :func:`gpu_workers.engine.generate_from_embeddings`) yields exactly the tokens of
:func:`generate_monolithic` for the same prompt and pixels, for every family of
:mod:`schemas.families`; what it must reproduce for that is listed in :mod:`gpu_workers.compute`.

:func:`monolithic_inputs` / :func:`monolithic_video_inputs` turn a ``RenderEvent`` (with inline
tensors) into ``generate``'s arguments, :func:`mm_token_type_ids` marks the pad tokens as the
processor does, and :func:`generate_monolithic` runs it. Nothing here serves requests: no
worker imports this module.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from gpu_workers.compute import TOKEN_TYPE
from runtime.model import ModelBundle, placeholder_ids, text_config
from schemas.errors import ComputeError, ValidationError
from schemas.modalities import GRID_FIELDS
from schemas.types import RenderEvent, SamplingParams


def mm_token_type_ids(bundle: ModelBundle, input_ids: torch.Tensor) -> torch.Tensor:
    """0 for text, 1 for image pad tokens, 2 for video pad tokens (what the processor returns)."""
    types = torch.zeros_like(input_ids, dtype=torch.int32)
    for modality, pad_id in placeholder_ids(bundle).items():
        types[input_ids == pad_id] = TOKEN_TYPE[modality]
    return types


def _oracle_sampling(bundle: ModelBundle, sampling: SamplingParams) -> dict[str, Any]:
    """``generate`` arguments for ``sampling``'s stop strings and (seeding the global
    generator, as a caller of ``generate`` would) its sampling."""
    kwargs: dict[str, Any] = {}
    if sampling.stop:
        kwargs["stop_strings"] = list(sampling.stop)
        kwargs["tokenizer"] = bundle.tokenizer
    if not sampling.greedy:
        if sampling.seed is None:
            raise ComputeError("the oracle samples only with an explicit seed")
        kwargs.update(
            do_sample=True,
            temperature=sampling.temperature,
            top_k=sampling.top_k,
            top_p=sampling.top_p,
        )
        torch.manual_seed(sampling.seed)
    return kwargs


def generate_monolithic(
    bundle: ModelBundle,
    token_ids: Sequence[int],
    pixel_values: torch.Tensor | None,
    image_grid_thw: torch.Tensor | None,
    max_tokens: int,
    stop_token_ids: Sequence[int] = (),
    ignore_eos: bool = False,
    *,
    pixel_values_videos: torch.Tensor | None = None,
    video_grid_thw: torch.Tensor | None = None,
    second_per_grid_ts: torch.Tensor | None = None,
    sampling: SamplingParams | None = None,
) -> list[int]:
    """The oracle: ``model.generate`` on raw pixels in one process, greedy; new tokens only.

    ``sampling`` (when it samples): ``generate(do_sample=True)`` with its temperature, top-k
    and top-p spelled out (``generate`` would otherwise apply its own default top-k of 50), the
    global generator seeded with its ``seed`` first, and its stop strings as ``stop_strings``;
    its ``max_tokens`` and stops replace the arguments above.

    Video items (all of them, concatenated in offset order) go in ``pixel_values_videos`` /
    ``video_grid_thw``, with Qwen2.5-VL's ``second_per_grid_ts`` (one per video) when given.

    Not for concurrent use on one bundle: ``generate`` caches ``rope_deltas`` on the model.

    ``mm_token_type_ids`` is always passed: transformers 5.x computes M-RoPE from it, and
    generate without it yields different tokens after a few steps.
    """
    if sampling is not None:
        max_tokens = sampling.max_tokens
        stop_token_ids, ignore_eos = sampling.stop_token_ids, sampling.ignore_eos
    if max_tokens <= 0:
        return []
    ids = torch.tensor([list(token_ids)], dtype=torch.long, device=bundle.device)
    stops = [int(t) for t in stop_token_ids]
    if not ignore_eos:
        stops.append(bundle.eos_token_id)
    kwargs: dict[str, Any] = {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "mm_token_type_ids": mm_token_type_ids(bundle, ids),
        "do_sample": False,
        "max_new_tokens": max_tokens,
        # An id outside the vocabulary never matches: "no stop token" without generate falling
        # back to the model's default eos.
        "eos_token_id": stops or [text_config(bundle.config).vocab_size + 1],
        "pad_token_id": bundle.eos_token_id,
    }
    if pixel_values is not None:
        kwargs["pixel_values"] = pixel_values.to(bundle.device)
        kwargs["image_grid_thw"] = torch.as_tensor(image_grid_thw).reshape(-1, 3).to(bundle.device)
    if pixel_values_videos is not None:
        kwargs["pixel_values_videos"] = pixel_values_videos.to(bundle.device)
        grid = torch.as_tensor(video_grid_thw).reshape(-1, 3).to(bundle.device)
        kwargs["video_grid_thw"] = grid
        if second_per_grid_ts is not None:
            kwargs["second_per_grid_ts"] = torch.as_tensor(second_per_grid_ts).reshape(-1)
    if sampling is not None:
        kwargs.update(_oracle_sampling(bundle, sampling))
    with torch.inference_mode():
        out = bundle.model.generate(**kwargs)
    new = out[0, ids.shape[1] :].tolist()
    return [int(t) for t in new]


def monolithic_inputs(
    event: RenderEvent,
) -> tuple[list[int], torch.Tensor | None, torch.Tensor | None]:
    """``(token_ids, pixel_values, image_grid_thw)`` for the one-process oracle.

    Image items are concatenated in placeholder (offset) order, which is the order
    ``model.generate`` assigns image features to pad-token runs. Needs inline tensors.
    Videos: :func:`monolithic_video_inputs`.
    """
    got = _stacked(event, "image", ("pixel_values", "image_grid_thw"))
    if not got:
        return list(event.token_ids), None, None
    return list(event.token_ids), got["pixel_values"], got["image_grid_thw"]


def monolithic_video_inputs(event: RenderEvent) -> dict[str, torch.Tensor]:
    """``model.generate`` keyword arguments of the event's videos (``pixel_values_videos``,
    ``video_grid_thw`` and, when the items carry it, ``second_per_grid_ts``) in offset order;
    empty without videos. Needs inline tensors."""
    fields: tuple[str, ...] = ("pixel_values_videos", "video_grid_thw")
    data = (event.features.kwargs_data or {}).get("video") or []
    if data and all(d is not None and "second_per_grid_ts" in d for d in data):
        fields = (*fields, "second_per_grid_ts")
    return _stacked(event, "video", fields)


def _stacked(event: RenderEvent, modality: str, fields: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """The items' ``fields`` concatenated in offset order (grids as ``(n, 3)`` rows)."""
    f = event.features
    ranges = f.mm_placeholders.get(modality, [])
    if not ranges:
        return {}
    if f.kwargs_data is None or modality not in f.kwargs_data:
        raise ValidationError("render.monolithic", f"the event carries no {modality} kwargs_data")
    data = f.kwargs_data[modality]
    order = sorted(range(len(ranges)), key=lambda i: ranges[i].offset)
    parts: dict[str, list[torch.Tensor]] = {name: [] for name in fields}
    for i in order:
        item = data[i]
        if item is None:
            raise ValidationError(
                "render.monolithic", "item has no data", modality=modality, item=i
            )
        for name in fields:
            t = item.get(name)
            if not isinstance(t, torch.Tensor):
                raise ValidationError(
                    "render.monolithic",
                    f"{', '.join(fields)} must be inline tensors",
                    modality=modality,
                    item=i,
                )
            parts[name].append(t.reshape(1, 3) if name == GRID_FIELDS[modality] else t)
    return {name: torch.cat(ts) for name, ts in parts.items()}
