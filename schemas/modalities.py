"""The modality-field table: the one place that says which item fields are what.

Every component reads it: the renderer (what it puts in ``mm_metadata``), the validator (what
counts as full data, what metadata must hold), the fan-out (what always travels inline), the
encode worker (which tensor goes into the vision tower), the prefill worker (which grid drives
M-RoPE positions) and the vLLM wire (which fields are ``keep_on_cpu`` batched vs flat).

The split follows vLLM's rule for ``mm_metadata``: an item's *metadata* is its placeholder
metadata and keep-on-CPU fields (the grids, video timing); everything the vision tower consumes is
an *encoder input* and travels only on the encode topic.

Which of these fields a given model family uses (and how) is the family table's business:
:mod:`schemas.families`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ModalityFields:
    """The fields of one modality's items."""

    modality: str
    encoder_inputs: tuple[str, ...]
    """What the encoder consumes; an item carrying these is "full data"."""
    metadata: tuple[str, ...]
    """Placeholder-metadata and keep-on-CPU fields: all that prefill may receive."""
    grid: str | None
    """The ``(t, h, w)`` patch grid that sizes the placeholder and drives M-RoPE positions."""
    required_metadata: tuple[str, ...]
    """Metadata the model needs for every item of this modality."""
    placeholder_token: str | None
    """The token repeated once per embedding in the prompt (None: no model here runs it)."""
    token_type: int | None
    """This modality's value in ``mm_token_type_ids`` (0 is text)."""

    @property
    def encoder_input(self) -> str:
        """The main encoder input (the tensor of patch rows)."""
        return self.encoder_inputs[0]


MODALITIES: dict[str, ModalityFields] = {
    "image": ModalityFields(
        modality="image",
        encoder_inputs=("pixel_values",),
        metadata=("image_grid_thw",),
        grid="image_grid_thw",
        required_metadata=("image_grid_thw",),
        placeholder_token="<|image_pad|>",
        token_type=1,
    ),
    "video": ModalityFields(
        modality="video",
        encoder_inputs=("pixel_values_videos",),
        metadata=("video_grid_thw", "second_per_grid_ts"),
        grid="video_grid_thw",
        required_metadata=("video_grid_thw",),
        placeholder_token="<|video_pad|>",
        token_type=2,
    ),
    # Audio appears in vLLM renders (e.g. Qwen2-Audio); no model of ours runs it, but the wire
    # and the validator still have to split and judge its items correctly.
    "audio": ModalityFields(
        modality="audio",
        encoder_inputs=("input_features",),
        metadata=("audio_feature_lengths",),
        grid=None,
        required_metadata=(),
        placeholder_token=None,
        token_type=None,
    ),
}

METADATA_FIELDS: frozenset[str] = frozenset(f for m in MODALITIES.values() for f in m.metadata)
"""Every field that may travel in ``mm_metadata``, over all modalities."""
ENCODER_INPUT_FIELDS: frozenset[str] = frozenset(
    f for m in MODALITIES.values() for f in m.encoder_inputs
)
"""Every encoder-input field, over all modalities."""
GRID_FIELDS: dict[str, str] = {k: m.grid for k, m in MODALITIES.items() if m.grid is not None}
"""modality -> its grid field."""
MAIN_ENCODER_INPUT: dict[str, str] = {k: m.encoder_input for k, m in MODALITIES.items()}
"""modality -> the tensor the vision tower consumes."""
REQUIRED_METADATA: dict[str, tuple[str, ...]] = {
    k: m.required_metadata for k, m in MODALITIES.items() if m.required_metadata
}
"""modality -> the metadata fields every item must carry."""


def metadata_of(modality: str) -> tuple[str, ...]:
    """The metadata fields of ``modality`` (all known metadata fields for an unknown one)."""
    m = MODALITIES.get(modality)
    return m.metadata if m is not None else tuple(sorted(METADATA_FIELDS))
