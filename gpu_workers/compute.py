"""The compute layer: encode, splice, M-RoPE and prefill, pure torch over a ``ModelBundle``, no
I/O. Decoding is :mod:`gpu_workers.engine`'s (one loop, batched); the reference it is all
checked against is :mod:`gpu_workers.oracle`.

These functions are synchronous and hold no locks; callers run them in worker threads. They use
``torch.inference_mode`` so no autograd state is kept.

What the split path must reproduce for its tokens to equal ``model.generate``'s (the parity
contract, :mod:`gpu_workers.oracle`): the M-RoPE positions (``get_rope_index`` with
``mm_token_type_ids`` and the family's extra arguments, e.g. Qwen2.5-VL's
``second_per_grid_ts``), the decode-step position (:meth:`Prefilled.position`: the prompt's last
position + 1 + step on each axis, as ``generate`` continues), and for Qwen3-VL the deepstack
features added to the first LLM layers at the visual positions (``visual_pos_masks``).
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DynamicCache

from runtime.bounds import context_overflow, outside_vocabulary
from runtime.model import ModelBundle, placeholder_ids, text_config, vision_config
from schemas.errors import ComputeError
from schemas.families import DEEPSTACK, EMBEDS
from schemas.modalities import GRID_FIELDS, MODALITIES

# mm_token_type_ids values understood by every family's get_rope_index (0 is text).
TOKEN_TYPE = {"text": 0} | {
    m: f.token_type for m, f in MODALITIES.items() if f.token_type is not None
}

EncoderOutput = dict[str, torch.Tensor]
"""One item's encoder outputs, named as the family's ``encoder_outputs`` (``embeds`` and, for
Qwen3-VL, ``deepstack``)."""


@dataclass(slots=True)
class ItemEmbedding:
    """One multimodal item's encoder output, placed in ``[offset, offset + length)``: at every
    position of it, or (``embed_mask``) at the positions the mask marks, in order."""

    modality: str
    offset: int
    length: int
    embeds: torch.Tensor  # (embedding positions, hidden)
    grid_thw: torch.Tensor  # (3,) or (1, 3), int
    deepstack: torch.Tensor | None = None
    """(layers, embedding positions, hidden): Qwen3-VL's deepstack features of this item."""
    metadata: Mapping[str, Any] = field(default_factory=dict)
    """The item's other metadata the positions read (e.g. ``second_per_grid_ts``)."""
    embed_mask: torch.Tensor | None = None
    """(length,) bool: which positions of the range take embeddings (the placeholder's
    ``is_embed``; a Qwen3-VL video's range also holds its frames' timestamp text). None: all."""

    def positions(self) -> torch.Tensor:
        """The prompt positions that take this item's embedding rows, in order."""
        span = torch.arange(self.offset, self.offset + self.length)
        return span if self.embed_mask is None else span[self.embed_mask]

    @property
    def embed_count(self) -> int:
        return self.length if self.embed_mask is None else int(self.embed_mask.sum())


def grid_values(grid_thw: torch.Tensor | Sequence[int]) -> tuple[int, int, int]:
    """A grid's ``(t, h, w)`` as ints; accepts (3,) or (1, 3). Python ints, not tensor ops:
    each tensor op costs tens of microseconds, several per item on every request."""
    if isinstance(grid_thw, torch.Tensor) and grid_thw.dtype == torch.int64:
        flat = grid_thw.reshape(-1).tolist()  # the usual grid: no conversion
    else:
        flat = torch.as_tensor(grid_thw, dtype=torch.int64).reshape(-1).tolist()
    if len(flat) != 3 or not all(v > 0 for v in flat):
        raise ComputeError(f"grid_thw must be three positive ints (t, h, w), got {flat}")
    t, h, w = flat
    return t, h, w


def grid_row(grid_thw: torch.Tensor | Sequence[int]) -> torch.Tensor:
    """A grid as a (3,) int64 CPU tensor; accepts (3,) or (1, 3)."""
    return torch.tensor(grid_values(grid_thw), dtype=torch.int64)


def tokens_for_grid(grid_thw: torch.Tensor | Sequence[int], merge_size: int) -> int:
    """Embedding rows (= placeholder tokens) one item yields: t*h*w / merge²."""
    t, h, w = grid_values(grid_thw)
    if h % merge_size or w % merge_size:
        raise ComputeError(f"grid h/w {h}x{w} not divisible by merge size {merge_size}")
    return t * h * w // (merge_size * merge_size)


# ---------------------------------------------------------------------------------------------
# encode


def encode_items(
    bundle: ModelBundle,
    items: Sequence[tuple[torch.Tensor, torch.Tensor]],
    *,
    to_cpu: bool = True,
) -> list[EncoderOutput]:
    """Run the vision tower ONCE over several images of any sizes; the outputs of each item.

    ``items``: ``(pixel_values (patches, C*T*P*P), image_grid_thw (3,) or (1, 3))`` per image,
    straight from the processor. The pixel rows are concatenated, the grids stacked, and the
    merged output split by ``t*h*w / merge²`` rows per item. The same function encodes video
    items (same tower, ``pixel_values_videos`` / ``video_grid_thw``).

    Each item gets the family's ``encoder_outputs``: ``embeds (tokens, hidden)`` and, for
    Qwen3-VL, ``deepstack (layers, tokens, hidden)`` (the deepstack mergers' outputs, split by the
    same rows). Model dtype; on CPU when ``to_cpu`` (for Redis/shm stores) or left on the model
    device.
    """
    if not items:
        return []
    visual = bundle.model.model.visual
    grids = torch.stack([grid_row(g) for _, g in items])
    splits = encoder_rows(bundle, items)
    with torch.inference_mode():
        pixels = torch.cat([pv for pv, _ in items]).to(device=bundle.device, dtype=visual.dtype)
        out = visual(pixels, grid_thw=grids.to(bundle.device))
        merged = out.pooler_output if hasattr(out, "pooler_output") else out
        if merged.shape[0] != sum(splits):
            raise ComputeError(
                f"vision tower returned {merged.shape[0]} rows, expected {sum(splits)}"
            )
        named: dict[str, tuple[torch.Tensor, ...]] = {EMBEDS: torch.split(merged, splits)}
        if bundle.family.has_deepstack:
            # (layers, rows, hidden): one tensor per item keeps the store entry to two tensors.
            stacked = torch.stack(list(out.deepstack_features))
            named[DEEPSTACK] = torch.split(stacked, splits, dim=1)
        move = (lambda t: t.to("cpu").clone()) if to_cpu else (lambda t: t.clone())
        return [{name: move(parts[i]) for name, parts in named.items()} for i in range(len(items))]


def encoder_rows(
    bundle: ModelBundle, items: Sequence[tuple[torch.Tensor, torch.Tensor]]
) -> list[int]:
    """The merged rows the vision tower yields for each item, once each item's pixel rows are
    checked against its grid."""
    for i, (pv, g) in enumerate(items):
        patches = math.prod(grid_values(g))
        if pv.ndim != 2 or pv.shape[0] != patches:
            raise ComputeError(
                f"item {i}: pixel_values shape {tuple(pv.shape)} does not match grid "
                f"{list(grid_values(g))} ({patches} patches)"
            )
    return [tokens_for_grid(g, bundle.merge_size) for _, g in items]


def encode_images(
    bundle: ModelBundle,
    items: Sequence[tuple[torch.Tensor, torch.Tensor]],
    *,
    to_cpu: bool = True,
) -> list[torch.Tensor]:
    """The main embedding of each item (``encode_items`` without the names), for families whose
    encoder yields nothing else; a deepstack family must use ``encode_items``."""
    if bundle.family.encoder_outputs != (EMBEDS,):
        raise ComputeError(
            f"{bundle.family.display_name} items have encoder outputs "
            f"{list(bundle.family.encoder_outputs)}; use encode_items"
        )
    return [o[EMBEDS] for o in encode_items(bundle, items, to_cpu=to_cpu)]


def item_embedding(
    modality: str,
    offset: int,
    length: int,
    outputs: Mapping[str, torch.Tensor],
    metadata: Mapping[str, Any],
    is_embed: Sequence[bool] | None = None,
) -> ItemEmbedding:
    """An ``ItemEmbedding`` from an item's encoder outputs, its ``mm_metadata`` entry and its
    placeholder's ``is_embed`` mask (None: every position)."""
    grid_name = GRID_FIELDS.get(modality)
    if grid_name is None or metadata.get(grid_name) is None:
        raise ComputeError(f"{modality} item has no {grid_name or 'grid'} for its positions")
    return ItemEmbedding(
        modality=modality,
        offset=offset,
        length=length,
        embeds=outputs[EMBEDS],
        grid_thw=metadata[grid_name],
        deepstack=outputs.get(DEEPSTACK),
        metadata={k: v for k, v in metadata.items() if k != grid_name},
        embed_mask=None if is_embed is None else torch.tensor(list(is_embed), dtype=torch.bool),
    )


# ---------------------------------------------------------------------------------------------
# bounds


def vocab_size(bundle: ModelBundle) -> int:
    """Rows of the model's token embedding table: every id fed to it must be below this."""
    return int(text_config(bundle.config).vocab_size)


def context_length(bundle: ModelBundle) -> int:
    """The model's context: ``max_position_embeddings`` of its text config."""
    return int(text_config(bundle.config).max_position_embeddings)


def kv_bytes_per_token(bundle: ModelBundle) -> int:
    """Bytes of KV cache one position takes: keys and values of every layer's KV heads."""
    tc = text_config(bundle.config)
    head_dim = getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads
    itemsize = torch.empty((), dtype=bundle.dtype).element_size()
    return 2 * int(tc.num_hidden_layers) * int(tc.num_key_value_heads) * int(head_dim) * itemsize


def check_token_range(bundle: ModelBundle, token_ids: Sequence[int]) -> None:
    """Every id in ``[0, vocab)``, checked before any tensor is built: on CUDA an id outside the
    embedding table is a device-side assert that kills the process and every request on it.
    The last guard under the workers' admission (the same wording as its rule)."""
    outside = outside_vocabulary([int(t) for t in token_ids], vocab_size(bundle))
    if outside is not None:
        raise ComputeError(outside[1])


# ---------------------------------------------------------------------------------------------
# prefill


def cache_kwarg(module: torch.nn.Module) -> str:
    """transformers renamed ``past_key_values`` to ``cache``; use whichever this version has.

    Looked up once per prefill and once per decode engine (not per step), so no memo is needed.
    """
    params = inspect.signature(type(module).forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def check_prompt(
    bundle: ModelBundle, token_ids: Sequence[int], items: Sequence[ItemEmbedding]
) -> list[ItemEmbedding]:
    """What a prefill checks before it runs: the ids in the vocabulary, the prompt within the
    context, each item's placeholder and embedding shapes. The items in prompt order."""
    if not token_ids:
        raise ComputeError("token_ids is empty")
    check_token_range(bundle, token_ids)
    overflow = context_overflow(len(token_ids), 0, context_length(bundle))
    if overflow is not None:
        raise ComputeError(overflow)
    return _check_items(bundle, token_ids, items)


def _check_items(
    bundle: ModelBundle, token_ids: Sequence[int], items: Sequence[ItemEmbedding]
) -> list[ItemEmbedding]:
    fam = bundle.family
    hidden = text_config(bundle.config).hidden_size
    pad_ids = placeholder_ids(bundle)
    layers = len(vision_config(bundle.config).deepstack_visual_indexes) if fam.has_deepstack else 0
    n = len(token_ids)
    ordered = sorted(items, key=lambda it: it.offset)
    prev_end = -1
    prev_mod = None
    for idx, it in enumerate(ordered):
        if it.modality not in pad_ids:
            raise ComputeError(f"item {idx}: modality {it.modality!r} is not supported")
        if it.offset < 0 or it.length <= 0 or it.offset + it.length > n:
            raise ComputeError(
                f"item {idx}: placeholder [{it.offset}, {it.offset + it.length}) outside the "
                f"{n}-token prompt"
            )
        if it.embed_mask is not None and tuple(it.embed_mask.shape) != (it.length,):
            raise ComputeError(f"item {idx}: is_embed has not {it.length} entries")
        if it.offset < prev_end:
            raise ComputeError(f"item {idx}: placeholder overlaps the previous item")
        if it.offset == prev_end and it.modality == prev_mod:
            # get_rope_index groups consecutive same-type tokens into one run and would give both
            # items the first item's grid; real prompts have vision_end/start in between.
            raise ComputeError(f"item {idx}: placeholder touches the previous {prev_mod} item")
        count = it.embed_count
        want = tokens_for_grid(it.grid_thw, bundle.merge_size)
        if count != want:
            raise ComputeError(
                f"item {idx}: placeholder holds {count} embedding positions, {want} implied by "
                f"grid {list(grid_values(it.grid_thw))}"
            )
        if tuple(it.embeds.shape) != (count, hidden):
            raise ComputeError(
                f"item {idx}: embeddings shape {tuple(it.embeds.shape)} != ({count}, {hidden})"
            )
        if fam.has_deepstack:
            want_ds = (layers, count, hidden)
            if it.deepstack is None or tuple(it.deepstack.shape) != want_ds:
                got = None if it.deepstack is None else tuple(it.deepstack.shape)
                raise ComputeError(
                    f"item {idx}: {fam.display_name} needs deepstack features of shape "
                    f"{want_ds}, got {got}"
                )
        elif it.deepstack is not None:
            raise ComputeError(f"item {idx}: {fam.display_name} has no deepstack features")
        _check_pads(bundle, token_ids, it, idx, pad_ids[it.modality])
        prev_end, prev_mod = it.offset + it.length, it.modality
    return ordered


def _check_pads(
    bundle: ModelBundle, token_ids: Sequence[int], it: ItemEmbedding, idx: int, pad: int
) -> None:
    """The item's embedding positions hold its pad token and its other positions do not (the
    positions come from the pad runs); a timestamped video has one run per temporal row."""
    span = token_ids[it.offset : it.offset + it.length]
    if it.embed_mask is None:
        # Every position is the pad (an image's run): a plain scan, no tensors to build.
        wrong = any(t != pad for t in span)
    else:
        run, mask = torch.tensor(list(span)), it.embed_mask
        wrong = bool((run[mask] != pad).any()) or bool((run[~mask] == pad).any())
    if wrong:
        raise ComputeError(
            f"item {idx}: the {it.modality} pad tokens of the placeholder are not exactly its "
            "embedding positions"
        )
    if it.modality != "video" or not bundle.family.video_timestamps:
        return
    mask = torch.ones(it.length, dtype=torch.bool) if it.embed_mask is None else it.embed_mask
    t, h, w = grid_values(it.grid_thw)
    per_row = h * w // bundle.merge_size**2
    # Runs of embedding positions: where the mask switches on.
    starts = int(mask[0]) + int((mask[1:] & ~mask[:-1]).sum())
    if starts != t:
        # Qwen3-VL's positions treat each run of video pads as one frame; the rows of one
        # video come apart only with the timestamp text between them.
        raise ComputeError(
            f"item {idx}: {bundle.family.display_name} video placeholders hold one temporal "
            f"grid row per run of pads ({per_row} each, with timestamp text between), grid "
            f"has {t} in {starts} run(s)"
        )


def _rope_value(it: ItemEmbedding, name: str, default: float | None) -> torch.Tensor:
    """One item's value of a non-grid ``get_rope_index`` argument (a positive finite scalar)."""
    raw = it.metadata.get(name)
    if raw is None:
        if default is None:
            raise ComputeError(f"{it.modality} item at {it.offset} lacks {name!r}")
        return torch.tensor(float(default))
    v = torch.as_tensor(raw).reshape(-1)
    if v.numel() != 1 or v.dtype == torch.bool:
        raise ComputeError(f"{name} must be one number per item, got shape {list(v.shape)}")
    x = float(v[0])
    if not math.isfinite(x) or x <= 0:
        raise ComputeError(f"{name} must be positive and finite, got {x}")
    return v[0].float()


def rope_arguments(bundle: ModelBundle, items: Sequence[ItemEmbedding]) -> dict[str, torch.Tensor]:
    """The family's ``get_rope_index`` keyword arguments, stacked over items in offset order
    (the order get_rope_index consumes them in)."""
    ordered = sorted(items, key=lambda it: it.offset)
    out: dict[str, torch.Tensor] = {}
    for arg in bundle.family.rope_args:
        mine = [it for it in ordered if it.modality == arg.modality]
        if not mine:
            continue
        if arg.field == GRID_FIELDS.get(arg.modality):
            out[arg.name] = torch.stack([grid_row(it.grid_thw) for it in mine])
        else:
            out[arg.name] = torch.stack([_rope_value(it, arg.field, arg.default) for it in mine])
    return out


def mrope_positions(
    bundle: ModelBundle, token_ids: Sequence[int], items: Sequence[ItemEmbedding]
) -> tuple[torch.Tensor, int]:
    """M-RoPE position ids ``(3, 1, L)`` and the rope delta, via the family's get_rope_index."""
    ordered = sorted(items, key=lambda it: it.offset)
    ids = torch.tensor([list(token_ids)], dtype=torch.long)
    types = torch.zeros_like(ids, dtype=torch.int32)
    for it in ordered:
        types[0, it.positions()] = TOKEN_TYPE[it.modality]
    if not ordered:
        pos = torch.arange(ids.shape[1]).view(1, 1, -1).expand(3, 1, -1)
        return pos, 0
    position_ids, deltas = bundle.model.model.get_rope_index(
        ids, mm_token_type_ids=types, **rope_arguments(bundle, ordered)
    )
    return position_ids, int(deltas.reshape(-1)[0])


def deepstack_inputs(
    bundle: ModelBundle, token_ids: Sequence[int], items: Sequence[ItemEmbedding]
) -> dict[str, Any]:
    """Qwen3-VL's extra language-model inputs: ``visual_pos_masks (1, L)`` over every item's
    placeholder and, per deepstack layer, the items' features concatenated in position order
    (the rows the mask selects, in sequence order). Empty for other families or no items."""
    if not bundle.family.has_deepstack or not items:
        return {}
    ordered = sorted(items, key=lambda it: it.offset)
    mask = torch.zeros((1, len(token_ids)), dtype=torch.bool, device=bundle.device)
    for it in ordered:
        mask[0, it.positions().to(bundle.device)] = True
    feats = torch.cat([it.deepstack for it in ordered if it.deepstack is not None], dim=1)
    feats = feats.to(device=bundle.device, dtype=bundle.dtype)
    return {"visual_pos_masks": mask, "deepstack_visual_embeds": list(feats.unbind(0))}


def splice_embeddings(
    bundle: ModelBundle, token_ids: Sequence[int], items: Sequence[ItemEmbedding]
) -> torch.Tensor:
    """``inputs_embeds (1, L, hidden)``: token embeddings with each item's rows at its
    embedding positions."""
    lm = bundle.model.model.language_model
    ids = torch.tensor([list(token_ids)], dtype=torch.long, device=bundle.device)
    embeds = lm.embed_tokens(ids).clone()
    for it in items:
        embeds[0, it.positions().to(bundle.device)] = it.embeds.to(
            device=bundle.device, dtype=embeds.dtype
        )
    return embeds


@dataclass(slots=True)
class Prefilled:
    """State after prefill: KV cache, last-position logits, and where decoding resumes."""

    cache: Any
    logits: torch.Tensor  # (vocab,) float32, for the next token
    prompt_len: int
    next_position: tuple[int, int, int]
    """The M-RoPE position (temporal, height, width) the first generated token is fed at: the
    prompt's last position + 1 on each axis, as ``generate`` continues (which is not the
    largest position + 1 when a video's temporal positions run past the text after it, as
    Qwen2.5-VL's do for a short tail); step ``s`` adds ``s`` on every axis."""

    def position(self, step: int) -> tuple[int, int, int]:
        """The M-RoPE position of decode step ``step`` (0: the first generated token)."""
        t, h, w = self.next_position
        return (t + step, h + step, w + step)


def prefill(
    bundle: ModelBundle, token_ids: Sequence[int], items: Sequence[ItemEmbedding]
) -> Prefilled:
    """Splice the embeddings, compute M-RoPE positions and run the prompt through the LM (with
    the deepstack features at the visual positions, for Qwen3-VL)."""
    ordered = check_prompt(bundle, token_ids, items)
    lm = bundle.model.model.language_model
    with torch.inference_mode():
        embeds = splice_embeddings(bundle, token_ids, ordered)
        position_ids, _ = mrope_positions(bundle, token_ids, ordered)
        kv = DynamicCache(config=text_config(bundle.config))
        out = lm(
            inputs_embeds=embeds,
            position_ids=position_ids.to(bundle.device),
            use_cache=True,
            **{cache_kwarg(lm): kv},
            **deepstack_inputs(bundle, token_ids, ordered),
        )
        logits = bundle.model.lm_head(out.last_hidden_state[:, -1, :])[0].float()
    t, h, w = (int(x) + 1 for x in position_ids[:, 0, -1].tolist())
    return Prefilled(cache=kv, logits=logits, prompt_len=len(token_ids), next_position=(t, h, w))
