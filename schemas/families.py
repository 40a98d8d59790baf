"""The model-family table: per supported ``model_type``, the facts every component needs.

It sits beside the modality-field table (:mod:`schemas.modalities`), which says what a field *is*
(encoder input, metadata, grid, placeholder token) for every modality any model here may carry.
This table says which of those a given model family uses, and how it uses them:

- which modalities it runs and, per modality, its metadata fields (the upstream rule: placeholder
  metadata and keep-on-CPU fields; Qwen2.5-VL adds the video timing ``second_per_grid_ts``);
- how M-RoPE positions are computed: the ``get_rope_index`` keyword arguments and the item
  metadata field each one is stacked from;
- what the vision tower produces per item (the main embedding; Qwen3-VL also its deepstack
  features, injected at the first LLM layers), i.e. the tensors of one embedding-store entry;
- the tiny seeded spec that builds a random model of the family for tests.

The transformers classes live with the loading code (``runtime/model.py``, ``FAMILY_CLASSES``),
keyed by the same ``model_type``: this module stays free of torch and transformers. Nothing else
names a model family.
"""

from __future__ import annotations

from dataclasses import dataclass

from schemas.modalities import MODALITIES

EMBEDS = "embeds"
"""The main encoder output of an item: ``(tokens, hidden)``, spliced at its placeholder."""
DEEPSTACK = "deepstack"
"""Qwen3-VL's deepstack features of an item: ``(layers, tokens, hidden)``, added to the hidden
states of the first ``layers`` LLM layers at the item's placeholder positions."""


@dataclass(frozen=True, slots=True)
class RopeArg:
    """One ``get_rope_index`` keyword argument, stacked over the items of one modality."""

    name: str
    modality: str
    field: str
    """The item metadata field each item contributes (its grid, or its video timing)."""
    default: float | None = None
    """Value for an item without the field (None: the field is required)."""


@dataclass(frozen=True, slots=True)
class ModelFamily:
    """What the pipeline needs to know about one ``model_type``."""

    model_type: str
    display_name: str
    tiny_spec: str
    """The ``--model`` value that builds this family's seeded tiny model."""
    metadata: dict[str, tuple[str, ...]]
    """modality -> its metadata fields in this family (a subset of the modality table's)."""
    rope_args: tuple[RopeArg, ...]
    encoder_outputs: tuple[str, ...]
    """The tensors the vision tower yields per item, stored together as one store entry."""
    default_merge_size: int = 2
    """The spatial merge size of published checkpoints (a checkpoint's config has the last word)."""
    video_timestamps: bool = False
    """The prompt lays a video out frame by frame: each temporal grid row is its own run of
    pads, ``<|vision_start|>`` ... ``<|vision_end|>``, after its timestamp text
    ``<{t:.1f} seconds>`` (Qwen3-VL). The item's placeholder spans all of it, with ``is_embed``
    marking the pads (as vLLM lays it out); otherwise a video is one run of pads."""
    notes: str = ""

    @property
    def modalities(self) -> tuple[str, ...]:
        """The modalities this family runs."""
        return tuple(self.metadata)

    @property
    def metadata_fields(self) -> frozenset[str]:
        """Every field an item of this family may carry in ``mm_metadata``."""
        return frozenset(f for fields in self.metadata.values() for f in fields)

    @property
    def placeholder_tokens(self) -> dict[str, str]:
        """modality -> the token its placeholder repeats."""
        return {
            m: tok for m in self.metadata if (tok := MODALITIES[m].placeholder_token) is not None
        }

    @property
    def has_deepstack(self) -> bool:
        """True when an item's store entry holds deepstack features besides the embedding."""
        return DEEPSTACK in self.encoder_outputs


_GRIDS = (
    RopeArg("image_grid_thw", "image", "image_grid_thw"),
    RopeArg("video_grid_thw", "video", "video_grid_thw"),
)

FAMILIES: dict[str, ModelFamily] = {
    "qwen2_vl": ModelFamily(
        model_type="qwen2_vl",
        display_name="Qwen2-VL",
        tiny_spec="tiny",
        metadata={"image": ("image_grid_thw",), "video": ("video_grid_thw",)},
        rope_args=_GRIDS,
        encoder_outputs=(EMBEDS,),
        notes="full attention in the vision tower",
    ),
    "qwen2_5_vl": ModelFamily(
        model_type="qwen2_5_vl",
        display_name="Qwen2.5-VL",
        tiny_spec="tiny-qwen2.5-vl",
        metadata={
            "image": ("image_grid_thw",),
            "video": ("video_grid_thw", "second_per_grid_ts"),
        },
        # transformers uses 1 s per temporal grid row when the timing is absent.
        rope_args=(*_GRIDS, RopeArg("second_per_grid_ts", "video", "second_per_grid_ts", 1.0)),
        encoder_outputs=(EMBEDS,),
        notes=(
            "window attention in the vision tower (full attention in fullatt_block_indexes); "
            "video M-RoPE temporal positions scaled by second_per_grid_ts x tokens_per_second"
        ),
    ),
    "qwen3_vl": ModelFamily(
        model_type="qwen3_vl",
        display_name="Qwen3-VL",
        tiny_spec="tiny-qwen3-vl",
        metadata={"image": ("image_grid_thw",), "video": ("video_grid_thw",)},
        rope_args=_GRIDS,
        encoder_outputs=(EMBEDS, DEEPSTACK),
        video_timestamps=True,
        notes=(
            "deepstack: features of early vision blocks are added to the first LLM layers' "
            "hidden states at the placeholder positions; they travel with the embedding in one "
            "store entry; interleaved M-RoPE; video frames separated by timestamps"
        ),
    ),
    "qwen3_vl_moe": ModelFamily(
        model_type="qwen3_vl_moe",
        display_name="Qwen3-VL-MoE",
        tiny_spec="tiny-qwen3-vl-moe",
        metadata={"image": ("image_grid_thw",), "video": ("video_grid_thw",)},
        rope_args=_GRIDS,
        encoder_outputs=(EMBEDS, DEEPSTACK),
        video_timestamps=True,
        notes="Qwen3-VL with a mixture-of-experts language model (e.g. Qwen3-VL-30B-A3B)",
    ),
}

TINY_SPECS: dict[str, str] = {f.tiny_spec: k for k, f in FAMILIES.items()}
TINY_SPECS["tiny-qwen2-vl"] = "qwen2_vl"  # the explicit name of the default tiny model
INSTANT_SPEC = "instant"
"""The instant engine: the tiny Qwen2-VL's processor, tokenizer, shapes and placeholder layout
with no model compute (``gpu_workers/instant.py``), so a request runs the whole real path with
the model's cost taken out. A bench and test aid for measuring the coordinator alone (what a
proxy is benchmarked with), not a served model."""
TINY_SPECS[INSTANT_SPEC] = "qwen2_vl"
"""``--model`` values that build a tiny model -> the family's ``model_type``."""

MODEL_HELP = (
    "a tiny seeded model ("
    + ", ".join(f"{f.tiny_spec}: {f.display_name}" for f in FAMILIES.values())
    + "), a local checkpoint directory of a supported family, or "
    + f"{INSTANT_SPEC} (no model compute: for measuring the coordinator)"
)
"""The ``--model`` help text of every command."""


class UnsupportedModelType(ValueError):
    """A ``model_type`` no family here runs; the message lists the supported ones."""


def family(model_type: str) -> ModelFamily:
    """The family of ``model_type``; :class:`UnsupportedModelType` names the supported ones."""
    fam = FAMILIES.get(model_type)
    if fam is None:
        raise UnsupportedModelType(
            f"model_type {model_type!r} is not supported; supported: "
            + ", ".join(f"{k} ({f.display_name})" for k, f in FAMILIES.items())
        )
    return fam


def _check_table() -> None:
    # The family table refines the modality table; a field it names must exist there.
    for fam in FAMILIES.values():
        for modality, fields in fam.metadata.items():
            known = MODALITIES[modality].metadata
            bad = [f for f in fields if f not in known]
            if bad:
                raise AssertionError(f"{fam.model_type}: {modality} metadata {bad} not in table")
        for arg in fam.rope_args:
            if arg.field not in fam.metadata.get(arg.modality, ()):
                raise AssertionError(f"{fam.model_type}: rope arg {arg.name} reads unknown field")


_check_table()
