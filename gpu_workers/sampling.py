"""Choosing each next token: greedy, or sampled exactly as transformers' ``generate`` samples.

A sampled request's logits go through transformers' own warpers in the order ``generate``
applies them (``TemperatureLogitsWarper``, then ``TopKLogitsWarper``, then
``TopPLogitsWarper``, each only when it changes something, keeping at least one token), then
softmax and one ``torch.multinomial`` draw from the request's own ``torch.Generator``. Seeded
with the request's seed, that generator yields the stream ``torch.manual_seed(seed)`` gives
``generate(do_sample=True, ...)``, so a seeded request's tokens equal transformers' and are the
same on every run and worker, alone or inside a batch (each sequence draws from its own
generator, in its own order).

A sampled request without a seed gets one derived from its request id: different requests
differ, and a redelivered or resumed request (another worker, a decode worker taking over)
makes the same tokens again, so a token stream never shows two continuations.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch
from transformers import (
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from schemas.types import SamplingParams

_NO_IDS = torch.LongTensor(1, 0)
"""The warpers take the ids so far; the three used here never read them."""


def request_seed(sampling: SamplingParams, request_id: str) -> int:
    """The seed a sampled request draws with: its own, or one derived from its request id."""
    if sampling.seed is not None:
        return int(sampling.seed)
    digest = hashlib.blake2b(f"epd-seed:{request_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1


def warpers(sampling: SamplingParams) -> LogitsProcessorList:
    """transformers' warpers for ``sampling``, in ``generate``'s order and on its conditions
    (a temperature of 1, a top-k of 0 and a top-p of 1 add nothing)."""
    out = LogitsProcessorList()
    if sampling.temperature != 1.0:
        out.append(TemperatureLogitsWarper(sampling.temperature))
    if sampling.top_k != 0:
        out.append(TopKLogitsWarper(top_k=sampling.top_k, min_tokens_to_keep=1))
    if sampling.top_p < 1.0:
        out.append(TopPLogitsWarper(top_p=sampling.top_p, min_tokens_to_keep=1))
    return out


@dataclass(slots=True)
class Sampler:
    """One sequence's token choice (not thread-safe: one sequence, one decode thread)."""

    warpers: LogitsProcessorList | None
    """None: greedy."""
    generator: torch.Generator | None

    @classmethod
    def for_request(
        cls, sampling: SamplingParams, request_id: str, device: torch.device
    ) -> Sampler:
        """Greedy at temperature 0; else the warpers and a generator seeded for the request."""
        if sampling.greedy:
            return cls(None, None)
        gen = torch.Generator(device=device)
        gen.manual_seed(request_seed(sampling, request_id))
        return cls(warpers(sampling), gen)

    def choose(self, logits: torch.Tensor) -> int:
        """The next token from the last position's logits (``(vocab,)``, float32)."""
        if self.warpers is None:
            return int(torch.argmax(logits))
        # (1, vocab), as generate holds them: the warpers and the draw see the same shapes.
        scores = self.warpers(_NO_IDS, logits.reshape(1, -1))
        probs = torch.nn.functional.softmax(scores, dim=-1)
        return int(torch.multinomial(probs, num_samples=1, generator=self.generator)[0, 0])
