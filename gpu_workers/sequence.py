"""One request's decode state: its tokens, its text, and whether (and why) it has finished.

Pure bookkeeping, no model: the decode loop (alone or batched) asks :meth:`DecodeState.choose` for
the next token from the sequence's logits and hands it to :meth:`DecodeState.accept`, which says
whether generation ends there. Ending conditions: eos (unless ``ignore_eos``) or a stop token
(the token is kept), a stop string (generation ends at the token that completes it; the string
and anything after it are cut from the text), ``max_tokens``.

Text is built incrementally (:class:`runtime.tokenizer.IncrementalDetokenizer`); what
:meth:`DecodeState.take_new` hands to a token stream never holds half a character, nor the start
of what may still become a stop string (that text waits until it is clearly not one).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from gpu_workers.sampling import Sampler
from runtime.tokenizer import IncrementalDetokenizer
from schemas.types import SamplingParams

STOP = "stop"
"""Finish reason: eos, a stop token or a stop string."""
LENGTH = "length"
"""Finish reason: ``max_tokens`` generated."""


@dataclass(slots=True)
class DecodeState:
    """A request being decoded; build it with :meth:`start`."""

    request_id: str
    sampling: SamplingParams
    sampler: Sampler
    detok: IncrementalDetokenizer
    stop_ids: frozenset[int]
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    """The text so far (cut at a stop string once one is found)."""
    finish_reason: str | None = None
    _checked: int = 0  # text[:_checked] holds no stop string
    _streamed_tokens: int = 0
    _streamed_chars: int = 0

    @classmethod
    def start(
        cls,
        request_id: str,
        sampling: SamplingParams,
        tokenizer: object,
        eos_token_id: int,
        device: torch.device,
    ) -> DecodeState:
        """The state of a request about to decode its first token."""
        stops = {int(t) for t in sampling.stop_token_ids}
        if not sampling.ignore_eos:
            stops.add(int(eos_token_id))
        return cls(
            request_id=request_id,
            sampling=sampling,
            sampler=Sampler.for_request(sampling, request_id, device),
            detok=IncrementalDetokenizer(tokenizer),  # type: ignore[arg-type]
            stop_ids=frozenset(stops),
        )

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def choose(self, logits: torch.Tensor) -> int:
        """The next token from this sequence's last-position logits (``(vocab,)``)."""
        return self.sampler.choose(logits)

    def accept(self, token: int) -> bool:
        """Record one generated token; True when generation ends with it."""
        if self.done:
            raise RuntimeError(f"{self.request_id}: a token after the sequence finished")
        self.tokens.append(int(token))
        cut = self._add_text(self.detok.push(token))
        if cut:
            self.finish_reason = STOP
        elif int(token) in self.stop_ids:
            self.finish_reason = STOP
        elif len(self.tokens) >= self.sampling.max_tokens:
            self.finish_reason = LENGTH
        if self.finish_reason is not None and not cut and self._add_text(self.detok.finish()):
            self.finish_reason = STOP  # the rest held a stop string
        return self.done

    def settle(self) -> None:
        """The request stops here without finishing (a cancel, the deadline): take in the text
        still held back for an incomplete character, as a full decode would show it."""
        if not self.done:
            self._add_text(self.detok.finish())

    def _add_text(self, piece: str) -> bool:
        """Append ``piece``; True when a stop string now appears (the text is cut before it)."""
        if not piece:
            return False
        self.text += piece
        stops = self.sampling.stop
        if not stops:
            return False
        # Only where a stop string could end in the new text: from its length back.
        start = max(0, self._checked - max(len(s) for s in stops) + 1)
        hits = [i for i in (self.text.find(s, start) for s in stops) if i >= 0]
        if hits:
            self.text = self.text[: min(hits)]
        self._checked = len(self.text)
        return bool(hits)

    def _held_back(self) -> int:
        """Characters at the end of the text that may be the start of a stop string."""
        if self.done or not self.sampling.stop:
            return 0
        longest = 0
        for s in self.sampling.stop:
            for n in range(min(len(s) - 1, len(self.text)), longest, -1):
                if self.text.endswith(s[:n]):
                    longest = n
                    break
        return longest

    def take_new(self) -> tuple[list[int], str]:
        """The tokens and text not handed out yet (for a token stream); text that may still
        turn out to start a stop string stays back until it is clear."""
        tokens = self.tokens[self._streamed_tokens :]
        visible = len(self.text) - self._held_back()
        text = self.text[self._streamed_chars : visible] if visible > self._streamed_chars else ""
        self._streamed_tokens = len(self.tokens)
        self._streamed_chars += len(text)
        return tokens, text
