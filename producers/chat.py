"""Chat messages -> prompt token ids, through the model's own chat template.

The OpenAI-compatible routes turn a conversation (roles, text, images, videos) into one prompt
the way the checkpoint expects it: transformers' ``apply_chat_template`` with the checkpoint's
template (its tokenizer's, or a ``chat_template.jinja`` / ``chat_template.json`` beside it;
``EPD_CHAT_TEMPLATE`` overrides both; the tiny models carry one of their own,
``runtime.tokenizer.TINY_CHAT_TEMPLATE``). Images and videos go to the template as
``{"type": "image"}`` / ``{"type": "video"}`` parts; the Qwen templates write each as its
vision block (``<|vision_start|><|image_pad|><|vision_end|>``), which the renderer then lays out
for the item's grid.

User text is data, not layout: text holding a vision token is refused (it would add an item
the request does not have), and so is text holding any other of the tokenizer's special tokens
(``<|im_start|>``, ``<|im_end|>``, ``<|endoftext|>``...): tokenized as written, it would close
the user's turn and open one in another role (a forged system prompt). Text is checked as the
template joins it, not only part by part: adjacent text parts of a message run together
(``"<|im_"`` + ``"start|>"`` is ``<|im_start|>``), and the prompt the template writes must hold
no more special tokens than it writes for the same conversation with neutral text, wherever
user text would have joined another part, the template's own text or another message. The
prompt is split at
the template's own vision blocks and tokenized piece by piece, so a literal ``<image>`` in a
message stays text. The template must place exactly the request's items, in order; one that
drops or adds any is refused (``chat.template``).
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from producers.prompt_tokens import QWEN_IMAGE_BLOCK, QWEN_VIDEO_BLOCK, VISION_TOKENS
from runtime.model import RenderInfo
from schemas.errors import ValidationError
from schemas.families import TINY_SPECS

PartKind = Literal["text", "image", "video"]
NEUTRAL_TEXT = "x"
"""What stands for every text part in the conversation a prompt is compared with: no special
token, nor any part of one."""
_BLOCKS = re.compile(f"({re.escape(QWEN_IMAGE_BLOCK)}|{re.escape(QWEN_VIDEO_BLOCK)})")


@dataclass(frozen=True, slots=True)
class ChatPart:
    """One piece of a message: text, or the place of one image or video."""

    kind: PartKind
    text: str = ""
    where: str = ""
    """The request field it came from (``messages[1].content[0]``), for errors."""


@dataclass(slots=True)
class ChatMessage:
    """One message of a conversation, as the template sees it."""

    role: str
    parts: list[ChatPart] = field(default_factory=list)

    def template_content(self) -> str | list[dict[str, str]]:
        """The message's content in the shape chat templates read: a string for text alone,
        else typed parts."""
        if all(p.kind == "text" for p in self.parts):
            return "".join(p.text for p in self.parts)
        return [
            {"type": "text", "text": p.text} if p.kind == "text" else {"type": p.kind}
            for p in self.parts
        ]


def template_of(info: RenderInfo, model: str, override: Path | None = None) -> str | None:
    """The chat template a model is prompted with (see the module docstring), or None."""
    if override is not None:
        return override.read_text()
    own = getattr(info.tokenizer, "chat_template", None)
    if isinstance(own, str) and own:
        return own
    if model in TINY_SPECS:
        return None
    folder = Path(model).expanduser()
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text()
    packed = folder / "chat_template.json"
    if packed.is_file():
        found = json.loads(packed.read_text()).get("chat_template")
        return found if isinstance(found, str) else None
    return None


def check_text(
    text: str, field_name: str | None, control: Sequence[str] = (), *, joined: bool = False
) -> None:
    """Rule ``render.reserved_token``: message text holds no vision token, nor any of
    ``control`` (the tokenizer's other special tokens: :func:`control_tokens`). ``joined``:
    ``text`` is a part with the end of the parts before it, as the template joins them."""
    what = "message text, joined to the text parts before it," if joined else "message text"
    for token in VISION_TOKENS:
        if token in text:
            raise ValidationError(
                "render.reserved_token",
                f"{what} contains the reserved token {token!r}; send images and videos "
                "as image_url / video_url parts",
                field=field_name,
            )
    found = next((t for t in control if t in text), None)
    if found is not None:
        raise ValidationError(
            "render.reserved_token",
            f"{what} contains the special token {found!r}: only the chat template may "
            "write it (it opens or ends a turn, or ends the text)",
            field=field_name,
        )


def check_run(before: str, text: str, field_name: str | None, control: Sequence[str] = ()) -> str:
    """:func:`check_text` on one text part, and on it joined to ``before`` (the end of the text
    parts before it in its message: the template writes adjacent parts as one text). Returns
    the end of the joined text to give the next part: as long as a special token can reach
    back (one character short of the longest), so a long run costs no more than its parts."""
    check_text(text, field_name, control)
    joined = before + text
    if before:
        check_text(joined, field_name, control, joined=True)
    keep = max(map(len, (*VISION_TOKENS, *control))) - 1
    return joined[-keep:]


class ChatTemplate:
    """One model's chat template, applied to conversations."""

    def __init__(self, info: RenderInfo, template: str | None) -> None:
        self.info = info
        self.template = template
        self.control_tokens = control_tokens(info.tokenizer)
        specials = sorted({*self.control_tokens, *VISION_TOKENS}, key=lambda t: (-len(t), t))
        self._special_re = re.compile("|".join(map(re.escape, specials)))

    @classmethod
    def for_model(cls, info: RenderInfo, model: str, override: Path | None = None) -> ChatTemplate:
        """The template of ``model`` (a tiny spec or a checkpoint folder), or ``override``."""
        return cls(info, template_of(info, model, override))

    def check_control_tokens(self, messages: list[ChatMessage]) -> None:
        """:func:`check_run` on every run of text parts (the routes check each as they read
        it; this holds for every other caller)."""
        for m in messages:
            before = ""
            for part in m.parts:
                if part.kind != "text":
                    before = ""  # the template writes the item's vision block between
                    continue
                before = check_run(before, part.text, part.where or None, self.control_tokens)

    def check_prompt(self, messages: list[ChatMessage], text: str) -> None:
        """Rule ``render.reserved_token`` for a prompt (``text``, the template's writing of
        ``messages``) holding more of any special token than the template writes for the same
        conversation with neutral text: user text that formed one with what the template put
        beside it (another part, its own text, another message), however the template joins
        them."""
        neutral = [
            ChatMessage(
                m.role, [ChatPart("text", NEUTRAL_TEXT) if p.kind == "text" else p for p in m.parts]
            )
            for m in messages
        ]
        placed = self._specials(self.prompt_text(neutral))
        for token, n in self._specials(text).items():
            if n > placed[token]:
                raise ValidationError(
                    "render.reserved_token",
                    f"the prompt the chat template writes holds the special token {token!r} "
                    f"{n - placed[token]} more time(s) than the template itself places: message "
                    "text joined with the text beside it forms it; only the chat template may "
                    "write it",
                )

    def _specials(self, text: str) -> Counter[str]:
        """How many times each special token (vision tokens included) stands in ``text``."""
        return Counter(self._special_re.findall(text))

    def prompt_text(self, messages: list[ChatMessage]) -> str:
        """The conversation as the template writes it, ending with the assistant's turn."""
        if self.template is None:
            raise ValidationError(
                "chat.template",
                "the model has no chat template (none in its tokenizer or checkpoint); set "
                "EPD_CHAT_TEMPLATE to a Jinja template file",
            )
        conversation: list[dict[str, Any]] = [
            {"role": m.role, "content": m.template_content()} for m in messages
        ]
        try:
            text = self.info.tokenizer.apply_chat_template(
                conversation,
                chat_template=self.template,
                tokenize=False,
                add_generation_prompt=True,
            )
        except Exception as exc:  # a template's raise_exception(), or a Jinja error
            raise ValidationError(
                "chat.template", f"the chat template refused the conversation: {exc}"
            ) from None
        return str(text)

    def token_ids(self, messages: list[ChatMessage]) -> list[int]:
        """Prompt token ids: one vision block (start, pad, end) per image and video, in the
        order the messages give them, the text between tokenized as it stands."""
        self.check_control_tokens(messages)
        text = self.prompt_text(messages)
        self.check_prompt(messages, text)
        pieces = _BLOCKS.split(text)
        placed = ["image" if b == QWEN_IMAGE_BLOCK else "video" for b in pieces[1::2]]
        given = [p.kind for m in messages for p in m.parts if p.kind != "text"]
        if placed != given:
            raise ValidationError(
                "chat.template",
                f"the chat template placed {_count(placed)} where the messages hold "
                f"{_count(given)}",
            )
        info = self.info
        pad = {"image": info.image_token_id, "video": info.video_token_id}
        ids: list[int] = []
        for i, piece in enumerate(pieces):
            if i % 2:
                ids += [info.vision_start_id, pad[placed[i // 2]], info.vision_end_id]
            elif piece:
                ids += info.tokenizer.encode(piece, add_special_tokens=False)
        return ids


def control_tokens(tokenizer: Any) -> tuple[str, ...]:
    """The tokenizer's special tokens as text (its named ones and every added token marked
    special), longest first; the vision tokens are left to :func:`check_text`."""
    found = set(getattr(tokenizer, "all_special_tokens", ()) or ())
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    found.update(t.content for t in decoder.values() if getattr(t, "special", False))
    found.difference_update(VISION_TOKENS)
    return tuple(sorted((t for t in found if t), key=lambda t: (-len(t), t)))


def _count(kinds: Sequence[str]) -> str:
    images, videos = kinds.count("image"), kinds.count("video")
    return f"{images} image(s) and {videos} video(s) in the order {kinds}"
