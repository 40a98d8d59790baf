"""The instant engine (``EPD_MODEL=instant``): the workers' whole path with no model compute.

What a proxy is benchmarked with: every stage runs for real (render with the tiny Qwen2-VL's
processor and placeholder layout, fan-out, claim checks, the encode stage and its store entries,
prefill admission and the embedding wait, the decode batch's bookkeeping, token streams,
results), and the model is taken out. The encoder yields zero embeddings of the shapes the
tiny model's vision tower would (so the store moves the same bytes), a prefill checks the
prompt as a real one does and yields a start of the same shapes (a zero KV cache, so the decode
stage parks and restores real tensors), and each step gives every sequence its next token of a
fixed text (:data:`INSTANT_TEXT`, deterministic whatever the sampling). A bench and test aid
for measuring the coordinator alone (``epd bench coordinator``), not a served model.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from gpu_workers.compute import (
    EncoderOutput,
    ItemEmbedding,
    Prefilled,
    check_prompt,
    encoder_rows,
)
from gpu_workers.engine import DecodeEngine, DecodeJob, _Row, _StepReport
from gpu_workers.kv_handoff import kv_shape
from runtime.model import text_config
from schemas.errors import ComputeError
from schemas.families import EMBEDS

if TYPE_CHECKING:
    from runtime.model import ModelBundle
    from runtime.settings import Settings

INSTANT_TEXT = b"The instant engine ran no model. "
"""The bytes every instant answer spells, in turn (the tiny tokenizer's ids are bytes)."""


def instant_token(step: int) -> int:
    """The token an instant sequence chooses at decode step ``step`` (0: the first)."""
    return INSTANT_TEXT[step % len(INSTANT_TEXT)]


def instant_encode(
    bundle: ModelBundle, items: Sequence[tuple[torch.Tensor, torch.Tensor]]
) -> list[EncoderOutput]:
    """Zero embeddings of the shapes the vision tower yields for ``items`` (their pixel rows
    checked against their grids first, as the tower's caller does)."""
    if bundle.family.has_deepstack:
        raise ComputeError(f"the instant engine runs no {bundle.family.display_name} model")
    hidden = int(text_config(bundle.config).hidden_size)
    return [
        {EMBEDS: torch.zeros((rows, hidden), dtype=bundle.dtype)}
        for rows in encoder_rows(bundle, items)
    ]


class InstantEngine(DecodeEngine):
    """A :class:`DecodeEngine` whose starts and steps compute nothing: its admission, batch
    bounds, joins, drops, deadlines, cancels and callbacks are the real engine's."""

    def _bind_model(self) -> None:
        self._kv_shape = kv_shape(self.bundle)  # what a real prefill's cache holds per position

    def prefill(self, token_ids: Sequence[int], items: Sequence[ItemEmbedding]) -> Prefilled:
        """The prompt checked as a prefill checks it; a zero cache of its length."""
        check_prompt(self.bundle, token_ids, items)
        shape, n = self._kv_shape, len(token_ids)
        zeros = torch.zeros((1, shape.kv_heads, n, shape.head_dim), dtype=self.bundle.dtype)
        return Prefilled(
            cache=[(zeros, zeros)] * shape.layers,
            logits=torch.zeros(self.bundle.vocab_size),
            prompt_len=n,
            next_position=(n, n, n),
        )

    def _choose(self, job: DecodeJob, logits: torch.Tensor) -> int:
        return instant_token(len(job.seq.tokens))

    def _merge(self, job: DecodeJob, state: Prefilled) -> None:
        self._rows.append(_Row(job, state, state.prompt_len))
        self.largest_batch = max(self.largest_batch, len(self._rows))

    def _keep_rows(self, keep: list[int]) -> None:
        self._rows = [self._rows[i] for i in keep]

    def _forward(self, report: _StepReport) -> None:
        self.steps += 1
        for row in self._rows:
            seq = row.job.seq
            seq.accept(self._choose(row.job, row.state.logits))
            report.tokens.append((row.job, *seq.take_new()))


def engine_for(settings: Settings, bundle: ModelBundle) -> DecodeEngine:
    """The worker's decode engine for ``bundle``: the instant engine for ``EPD_MODEL=instant``,
    else the model's, with the deployment's batch bounds."""
    return (InstantEngine if bundle.instant else DecodeEngine).for_settings(settings, bundle)
