"""A prompt, as text or as token ids -> the token runs between its media marks and the modality
of each mark, in prompt order: the renderer's first phase (:mod:`producers.render`).

A text prompt marks each image with ``<image>`` and each video with ``<video>`` (or the chat
template's blocks, which count as marks); token ids mark each with one ``<|image_pad|>`` /
``<|video_pad|>``, optionally wrapped in ``<|vision_start|>`` ... ``<|vision_end|>``. The marks
must match the items given, one for one.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from producers.render_errors import RenderError
from runtime.bounds import outside_vocabulary
from runtime.model import RenderInfo, placeholder_ids

IMAGE_MARKER = "<image>"
# What the Qwen2-VL chat template emits for one image; accepted as an alias of the marker.
QWEN_IMAGE_BLOCK = "<|vision_start|><|image_pad|><|vision_end|>"
VIDEO_MARKER = "<video>"
QWEN_VIDEO_BLOCK = "<|vision_start|><|video_pad|><|vision_end|>"
_MARKERS = re.compile(f"({re.escape(IMAGE_MARKER)}|{re.escape(VIDEO_MARKER)})")

VISION_TOKENS = (
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<|vision_pad|>",
)

Segments = tuple[list[list[int]], list[str]]
"""Token ids of the runs between marks (one more than the marks) and each mark's modality."""


def _marker_count_message(
    prompt: str, kind: str, marker: str, block: str, found: int, given: int
) -> str:
    """Marks of one modality vs the items given, each spelling of a mark counted apart (the
    chat template's block counts as a mark, which a prompt mixing both spellings trips on)."""
    blocks = prompt.count(block)
    spelled = f"{found - blocks} {marker!r}"
    if blocks:
        spelled += f" and {blocks} {block!r} (the chat template's {kind} block, also a mark)"
    items = f"{given} {kind} was" if given == 1 else f"{given} {kind}s were"
    marks = f"{found} {kind}" + ("" if found == 1 else "s")
    return f"the prompt marks {marks} ({spelled}) but {items} given"


class PromptTokens:
    """Splits one model's prompts at their media marks."""

    def __init__(self, info: RenderInfo) -> None:
        self.info = info
        tok = info.tokenizer
        self.reserved = {
            s: i
            for s in VISION_TOKENS
            if (i := tok.convert_tokens_to_ids(s)) is not None and i != tok.unk_token_id
        }
        """The vision tokens this tokenizer has, which a text prompt may not spell out."""

    def text_ids(self, text: str) -> list[int]:
        """``text``'s token ids, without special tokens."""
        return list(self.info.tokenizer.encode(text, add_special_tokens=False))

    def from_prompt(self, prompt: str, n_images: int, n_videos: int = 0) -> Segments:
        """Token ids of the text between markers (one more than the markers) and the modality of
        each marker, in prompt order. Only the vision tokens are reserved: a native prompt is
        the whole prompt, its turn markers written by its client (``token_ids`` may hold any
        token too), unlike a chat message, whose text the chat template frames."""
        text = prompt.replace(QWEN_IMAGE_BLOCK, IMAGE_MARKER).replace(
            QWEN_VIDEO_BLOCK, VIDEO_MARKER
        )
        for s in self.reserved:
            if s in text:
                raise RenderError(
                    "render.reserved_token",
                    f"prompt contains the reserved token {s!r}; mark images with "
                    f"{IMAGE_MARKER!r} and videos with {VIDEO_MARKER!r}",
                    field="prompt",
                )
        parts = _MARKERS.split(text)
        kinds = ["image" if m == IMAGE_MARKER else "video" for m in parts[1::2]]
        for kind, marker, block, given in (
            ("image", IMAGE_MARKER, QWEN_IMAGE_BLOCK, n_images),
            ("video", VIDEO_MARKER, QWEN_VIDEO_BLOCK, n_videos),
        ):
            if kinds.count(kind) != given:
                raise RenderError(
                    "render.marker_count",
                    _marker_count_message(prompt, kind, marker, block, kinds.count(kind), given),
                    field="prompt",
                )
        return [self.text_ids(p) for p in parts[0::2]], kinds

    def from_token_ids(
        self, token_ids: Sequence[int], n_images: int, n_videos: int = 0
    ) -> Segments:
        """Split token ids at each single ``<|image_pad|>`` / ``<|video_pad|>``, dropping a
        vision_start/end wrap; also the modality of each mark, in order."""
        info = self.info
        ids = [int(t) for t in token_ids]
        outside = outside_vocabulary(ids, info.vocab_size)
        if outside is not None:
            raise RenderError("render.token_ids", outside[1], field="token_ids", item=outside[0])
        pads = {pad: modality for modality, pad in placeholder_ids(info).items()}
        marks = [i for i, t in enumerate(ids) if t in pads]
        kinds = [pads[ids[i]] for i in marks]
        for kind, given in (("image", n_images), ("video", n_videos)):
            if kinds.count(kind) != given:
                raise RenderError(
                    "render.marker_count",
                    f"token_ids have {kinds.count(kind)} {kind} pad tokens but {given} {kind}s "
                    f"were given (mark each {kind} with one <|{kind}_pad|>)",
                    field="token_ids",
                )
        segments = self._unwrap(ids, marks)
        for seg in segments:
            if info.vision_start_id in seg or info.vision_end_id in seg:
                raise RenderError(
                    "render.token_ids",
                    "vision start/end tokens must wrap an image or video pad token",
                    field="token_ids",
                )
        return segments, kinds

    def _unwrap(self, ids: list[int], marks: list[int]) -> list[list[int]]:
        """The runs of ``ids`` between the pad tokens at ``marks``, less the
        ``<|vision_start|>`` / ``<|vision_end|>`` right around each pad."""
        segments: list[list[int]] = []
        start = 0
        for m in marks:
            end = m
            if end - 1 >= start and ids[end - 1] == self.info.vision_start_id:
                end -= 1
            segments.append(ids[start:end])
            start = m + 1
            if start < len(ids) and ids[start] == self.info.vision_end_id:
                start += 1
        segments.append(ids[start:])
        return segments
