"""A tiny byte-level tokenizer that knows the Qwen2-VL special tokens (and a chat template of
its own), and incremental detokenisation (:class:`IncrementalDetokenizer`) for any tokenizer.

Ids 0-255 are the raw bytes (id == byte value), so any text round-trips and the vocabulary is
tiny; the Qwen2-VL special tokens follow. It is built with the ``tokenizers`` library and wrapped
in ``PreTrainedTokenizerFast`` so callers use one interface for the tiny model and real checkpoints.
"""

from __future__ import annotations

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

# The Qwen2-VL special tokens, in the order the real vocabulary lists them (151643...).
SPECIAL_TOKENS: tuple[str, ...] = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
BYTE_VOCAB = 256
TINY_VOCAB_SIZE = BYTE_VOCAB + len(SPECIAL_TOKENS)
EOS_TOKEN = "<|endoftext|>"

TINY_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}"
    "{% elif part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'video' %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""The tiny models' chat template: ChatML as the Qwen2-VL checkpoints write it (one
``<|im_start|>ROLE`` line per message, each image or video as its vision block), without a
default system message."""


def _byte_to_unicode() -> dict[int, str]:
    """The GPT-2 byte-level alphabet: every byte maps to one printable unicode character.

    Printable latin-1 bytes map to themselves; the rest are shifted above U+0100 so that the BPE
    model never sees whitespace or control characters.
    """
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    mapping: dict[int, str] = {b: chr(b) for b in keep}
    shift = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + shift)
            shift += 1
    return mapping


def build_tiny_tokenizer() -> PreTrainedTokenizerFast:
    """The byte-level tokenizer of the ``tiny`` model (deterministic, no files needed)."""
    vocab = {ch: b for b, ch in _byte_to_unicode().items()}
    # BPE with no merges over the byte alphabet is exactly a byte tokenizer.
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS_TOKEN, pad_token=EOS_TOKEN)
    fast.chat_template = TINY_CHAT_TEMPLATE
    for i, t in enumerate(SPECIAL_TOKENS):
        # The wrapper must agree with the fixed layout the tiny model config relies on.
        if fast.convert_tokens_to_ids(t) != BYTE_VOCAB + i:
            raise RuntimeError(f"tiny tokenizer layout broken: {t!r} is not id {BYTE_VOCAB + i}")
    return fast


class IncrementalDetokenizer:
    """Text of a growing token sequence, a piece per token, never half a character.

    A byte-level tokenizer splits a multi-byte character across tokens; decoding those tokens
    alone gives U+FFFD. Each :meth:`push` decodes only a short window (from the last point where
    the text was whole), and holds text back while the window ends in an incomplete character,
    so streaming costs O(1) per token and the pieces join to exactly
    ``tokenizer.decode(all_tokens, skip_special_tokens=...)`` (:meth:`finish` adds the rest).
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, *, skip_special_tokens: bool = True):
        self._decode = tokenizer.decode
        self._skip = skip_special_tokens
        self.tokens: list[int] = []
        self._prefix = 0  # where the window starts: a point where the text was whole
        self._read = 0  # tokens whose text has been handed out

    def _text(self, start: int, end: int) -> str:
        return str(self._decode(self.tokens[start:end], skip_special_tokens=self._skip))

    def push(self, token: int) -> str:
        """Add one token; the new text it completes ('' while a character is still partial)."""
        self.tokens.append(int(token))
        before = self._text(self._prefix, self._read)
        now = self._text(self._prefix, len(self.tokens))
        if len(now) <= len(before) or now.endswith("\ufffd"):
            return ""
        self._prefix, self._read = self._read, len(self.tokens)
        return now[len(before) :]

    def finish(self) -> str:
        """The text still held back (an incomplete character at the very end, decoded as the
        full decode would decode it)."""
        before = self._text(self._prefix, self._read)
        now = self._text(self._prefix, len(self.tokens))
        self._prefix = self._read = len(self.tokens)
        return now[len(before) :]
