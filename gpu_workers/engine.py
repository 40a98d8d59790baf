"""Continuous batching: one decode forward pass per step over every active sequence.

A request joins between steps: its start (a prefill alone, exactly as a solo request's, or a
KV cache parked by a prefill worker) runs on the compute thread, its first token is chosen from
the start's logits, and its KV cache is merged into the batch's. Each step then feeds every
active sequence's last token in one forward over a left-padded batch (per-sequence M-RoPE
positions, each continuing from its own prompt; an attention mask over each sequence's
padding), and each sequence chooses its next token from its own row of logits with
its own sampler (its own seeded generator), so a sequence's tokens are those it makes alone. A
sequence leaves as soon as it finishes, is cancelled or passes its deadline (checked before
every step, as alone); the padding columns no sequence needs any more are dropped with it.

Logits in a batch agree with a solo run to about 1e-6 (batched matrix products round
differently from one row's); the tokens are the same (``tests/unit/test_batching.py`` checks
16 concurrent requests of every family against their solo ``generate``), as in any batching
engine without batch-invariant kernels, a near-tie could in principle round the other way.

Bounds (one home: ``EPD_DECODE_MAX_BATCH``, ``EPD_DECODE_KV_BUDGET_BYTES``): at most
``max_batch`` sequences, and a KV budget over the batch's padded cache at its largest
(sequences x the longest prompt + ``max_tokens`` among them x the model's KV bytes per token).
A request that does not fit waits in :meth:`DecodeEngine.run` (its handler holds its consume
loop slot, so a full engine pauses the loop's partitions: backpressure, never an unbounded
queue); one that could never fit alone is refused (rule ``kv-budget``).

One request alone (:func:`decode_alone`, :func:`generate_from_embeddings`) runs the same steps
with a batch of one on the calling thread: the token-exact comparisons with the reference
(:mod:`gpu_workers.oracle`) in the tests and ``bench/gpu.py`` decode through this loop, the
only one there is.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from transformers import DynamicCache

from gpu_workers.compute import ItemEmbedding, Prefilled, cache_kwarg, kv_bytes_per_token, prefill
from gpu_workers.sequence import DecodeState
from runtime.model import text_config
from runtime.thread_lane import ThreadLane
from schemas.errors import ValidationError
from schemas.statuses import TerminalStatus
from schemas.types import SamplingParams, now_ms
from schemas.values import deadline_passed

if TYPE_CHECKING:
    from runtime.model import ModelBundle
    from runtime.settings import Settings

log = logging.getLogger(__name__)

# A job's outcomes are the request statuses they end in (typed so, the contract's vocabulary).
COMPLETED: TerminalStatus = "completed"
CANCELLED: TerminalStatus = "cancelled"
EXPIRED: TerminalStatus = "expired"
T = TypeVar("T")


def new_sequence(
    bundle: ModelBundle, sampling: SamplingParams, request_id: str = ""
) -> DecodeState:
    """A :class:`DecodeState` for ``sampling`` on ``bundle`` (its tokenizer, eos and device)."""
    return DecodeState.start(
        request_id, sampling, bundle.tokenizer, bundle.eos_token_id, bundle.device
    )


@dataclass(eq=False)
class DecodeJob:
    """One request for the engine."""

    request_id: str
    seq: DecodeState
    start: Callable[[], Prefilled]
    """Runs on the compute thread when the request joins: its prefill, or its parked KV."""
    kv_tokens: int
    """Prompt + ``max_tokens``: the most cache positions it may hold."""
    deadline_ms: int | None = None
    should_stop: Callable[[], bool] | None = None
    """Asked on the compute thread before the start and before every step (a cancel)."""
    on_tokens: Callable[[list[int], str], None] | None = None
    """Called on the event loop after each step that gave the request tokens."""
    on_started: Callable[[], None] | None = None
    """Called on the event loop once its start ran."""
    _future: asyncio.Future[Finished] | None = None
    _abandoned: bool = False
    _start_ms: float = 0.0
    _context: contextvars.Context | None = None
    """The submitting task's context: its callbacks run in it (the request's trace and request
    id), not in the engine loop's, which steps every request's sequence."""


def _in_context(job: DecodeJob, callback: Callable[..., None], *args: Any) -> None:
    """``callback(*args)`` in the context the job was submitted from."""
    if job._context is None:
        callback(*args)
    else:
        job._context.run(callback, *args)


@dataclass(slots=True)
class Finished:
    """How a job ended: ``completed`` (its sequence says why), ``cancelled`` or ``expired``
    (with the tokens made before)."""

    outcome: TerminalStatus
    detail: str = ""
    start_ms: float = 0.0
    """Its start's compute time (prefill or KV restore)."""


@dataclass(eq=False)
class _Row:
    job: DecodeJob
    state: Prefilled
    length: int
    """Cache positions this sequence holds (its columns are the last ``length``)."""


@dataclass
class _StepReport:
    tokens: list[tuple[DecodeJob, list[int], str]] = field(default_factory=list)
    started: list[DecodeJob] = field(default_factory=list)
    finished: list[tuple[DecodeJob, Finished]] = field(default_factory=list)
    failed: list[tuple[DecodeJob, BaseException]] = field(default_factory=list)


CPU_KV_BUDGET_BYTES = 2 << 30
GPU_KV_SHARE = 0.4


def kv_budget_bytes(settings: Settings, bundle: ModelBundle) -> int:
    """``EPD_DECODE_KV_BUDGET_BYTES``, or (0) a share of the GPU memory free now (after the
    model loaded), or 2 GiB on CPU."""
    if settings.decode_kv_budget_bytes:
        return int(settings.decode_kv_budget_bytes)
    if bundle.device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(bundle.device)
        return int(free * GPU_KV_SHARE)
    return CPU_KV_BUDGET_BYTES


class DecodeEngine:
    """The batch of one worker's compute thread (see the module docstring)."""

    def __init__(
        self,
        bundle: ModelBundle,
        *,
        max_batch: int,
        kv_budget_bytes: int,
        lane: ThreadLane | None = None,
    ) -> None:
        self.bundle = bundle
        self.max_batch = max(1, max_batch)
        self.kv_budget_bytes = kv_budget_bytes
        self.kv_per_token = kv_bytes_per_token(bundle)
        self.lane = lane or ThreadLane("epd-decode")
        """The compute thread: every step, and calls between steps (:meth:`call`)."""
        self._text_config = text_config(bundle.config)
        self._bind_model()
        self._rows: list[_Row] = []
        self._cache: DynamicCache | None = None
        self._joining: list[DecodeJob] = []
        self._reserved: dict[DecodeJob, int] = {}
        self._room = asyncio.Condition()
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.steps = 0
        """Batched decode forwards run so far."""
        self.largest_batch = 0

    def _bind_model(self) -> None:  # the parts of the model each step calls
        self._lm = self.bundle.model.model.language_model
        self._cache_kw = cache_kwarg(self._lm)

    # ------------------------------------------------------------------------- admission

    def _padded_bytes(self, kv_tokens: list[int]) -> int:
        return len(kv_tokens) * max(kv_tokens, default=0) * self.kv_per_token

    def _fits(self, job: DecodeJob) -> bool:
        held = [*self._reserved.values(), job.kv_tokens]
        return len(held) <= self.max_batch and self._padded_bytes(held) <= self.kv_budget_bytes

    async def run(self, job: DecodeJob) -> Finished:
        """Decode ``job`` to its end, joining the batch once there is room for it."""
        if self._padded_bytes([job.kv_tokens]) > self.kv_budget_bytes:
            raise ValidationError(
                "kv-budget",
                f"prompt + max_tokens = {job.kv_tokens} positions need "
                f"{job.kv_tokens * self.kv_per_token} bytes of KV cache; this worker's budget "
                f"(EPD_DECODE_KV_BUDGET_BYTES) is {self.kv_budget_bytes}",
                field="max_tokens",
            )
        if not await self._admit(job):
            return Finished(EXPIRED, "deadline passed while waiting for room in the batch")
        loop = asyncio.get_running_loop()
        job._future = loop.create_future()
        job._context = contextvars.copy_context()
        self._joining.append(job)
        self._wake.set()
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._loop(), name="epd-decode-engine")
        try:
            return await asyncio.shield(job._future)
        except asyncio.CancelledError:
            job._abandoned = True  # the engine drops it at its next step
            raise
        finally:
            await self._release(job)

    async def _admit(self, job: DecodeJob) -> bool:
        """Wait for room; False when the deadline passed first."""
        async with self._room:
            while not self._fits(job):
                timeout = None
                if job.deadline_ms is not None:
                    timeout = (job.deadline_ms - now_ms()) / 1000
                    if timeout <= 0:
                        return False
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._room.wait(), timeout)
            self._reserved[job] = job.kv_tokens
        return True

    async def _release(self, job: DecodeJob) -> None:
        async with self._room:
            if self._reserved.pop(job, None) is not None:
                self._room.notify_all()

    def prefill(self, token_ids: Sequence[int], items: Sequence[ItemEmbedding]) -> Prefilled:
        """A prompt's start (for the compute thread): its prefill on this engine's model."""
        return prefill(self.bundle, token_ids, items)

    async def call(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the compute thread between two steps (a prefill that is handed off
        rather than decoded here)."""
        return await self.lane.run(fn)

    @classmethod
    def for_settings(cls, settings: Settings, bundle: ModelBundle) -> DecodeEngine:
        """An engine with the deployment's batch bounds."""
        return cls(
            bundle,
            max_batch=settings.decode_max_batch,
            kv_budget_bytes=kv_budget_bytes(settings, bundle),
        )

    @property
    def active(self) -> int:
        """Sequences in the batch now."""
        return len(self._rows)

    # ------------------------------------------------------------------------- the loop

    async def _loop(self) -> None:
        while True:
            if not self._rows and not self._joining:
                self._wake.clear()
                await self._wake.wait()
                continue
            joining, self._joining = self._joining, []
            try:
                report = await self.lane.run(self._step, joining)
            except Exception as exc:  # a failed batched forward fails the batch, not the worker
                log.exception("decode step failed; failing the %d sequences in it", self.active)
                report = _StepReport(failed=[(r.job, exc) for r in self._rows])
                report.failed += [(j, exc) for j in joining]
                self._rows, self._cache = [], None
            self._deliver(report)

    def _deliver(self, report: _StepReport) -> None:
        _call_back(report)
        for job, done in report.finished:
            if job._future is not None and not job._future.done():
                job._future.set_result(done)
        for job, exc in report.failed:
            if job._future is not None and not job._future.done():
                job._future.set_exception(exc)

    def run_alone(self, job: DecodeJob) -> Finished:
        """Decode ``job`` to its end on the calling thread, as the only sequence of an idle
        engine: the steps :meth:`run` takes for it (its start, then a forward per token, the
        deadline and ``should_stop`` asked before the start and before each step), with no
        event loop. What its start raises propagates; its callbacks run on this thread."""
        if self._rows or self._joining or (self._task is not None and not self._task.done()):
            raise RuntimeError("run_alone needs an idle engine")
        joining = [job]
        while True:
            report = self._step(joining)
            joining = []
            _call_back(report)
            for _, exc in report.failed:
                raise exc
            for _, done in report.finished:
                return done
            if not self._rows:
                raise RuntimeError(f"{job.request_id}: left the engine without an outcome")

    # --------------------------------------------------------------- the compute thread

    def _step(self, joining: list[DecodeJob]) -> _StepReport:
        report = _StepReport()
        with torch.inference_mode():
            for job in joining:
                self._join(job, report)
            self._drop(report, check_stops=True)  # the deadline and cancels: once per step
            if self._rows:
                self._forward(report)
                self._drop(report, check_stops=False)
        return report

    def _stopped(self, job: DecodeJob) -> Finished | None:
        if deadline_passed(job.deadline_ms, now_ms()):
            return Finished(EXPIRED, f"deadline passed after {len(job.seq.tokens)} tokens")
        if job.should_stop is not None and job.should_stop():
            return Finished(CANCELLED, f"stopped after {len(job.seq.tokens)} tokens")
        return None

    def _join(self, job: DecodeJob, report: _StepReport) -> None:
        if job._abandoned:
            return
        stopped = self._stopped(job)
        if stopped is not None:
            report.finished.append((job, stopped))
            return
        t0 = time.perf_counter()
        try:
            state = job.start()
        except Exception as exc:  # this request's start failed; the batch goes on
            report.failed.append((job, exc))
            return
        start_ms = (time.perf_counter() - t0) * 1000
        report.started.append(job)
        done = job.seq.accept(self._choose(job, state.logits))
        report.tokens.append((job, *job.seq.take_new()))
        if done:
            report.finished.append((job, Finished(COMPLETED, start_ms=start_ms)))
            return
        job._start_ms = start_ms
        self._merge(job, state)

    def _choose(self, job: DecodeJob, logits: torch.Tensor) -> int:
        return job.seq.choose(logits)  # its own sampler, on its own row of logits

    def _merge(self, job: DecodeJob, state: Prefilled) -> None:
        """Add a started sequence's cache to the batch's, left-padding the shorter side."""
        new = [(k, v) for k, v, *_ in state.cache]
        length = int(new[0][0].shape[-2])
        row = _Row(job, state, length)
        if self._cache is None or not self._rows:
            self._cache, self._rows = state.cache, [row]
            return
        old = [(k, v) for k, v, *_ in self._cache]
        width = max(int(old[0][0].shape[-2]), length)
        layers = [
            (
                torch.cat([_left_pad(ko, width), _left_pad(kn, width)]),
                torch.cat([_left_pad(vo, width), _left_pad(vn, width)]),
            )
            for (ko, vo), (kn, vn) in zip(old, new, strict=True)
        ]
        self._cache = DynamicCache(ddp_cache_data=layers, config=self._text_config)
        self._rows.append(row)
        self.largest_batch = max(self.largest_batch, len(self._rows))

    def _drop(self, report: _StepReport, *, check_stops: bool) -> None:
        """Remove finished and abandoned sequences, and (``check_stops``) those past their
        deadline or cancelled; with them, the padding no sequence left needs."""
        keep = self._survivors(report, check_stops=check_stops)
        if len(keep) == len(self._rows):
            return
        if not keep:
            self._rows, self._cache = [], None
            return
        self._keep_rows(keep)

    def _survivors(self, report: _StepReport, *, check_stops: bool) -> list[int]:
        """The rows that go on; the others' outcomes added to ``report``."""
        keep: list[int] = []
        for i, row in enumerate(self._rows):
            job = row.job
            if job._abandoned:
                continue
            if job.seq.done:
                report.finished.append((job, Finished(COMPLETED, start_ms=job._start_ms)))
                continue
            stopped = self._stopped(job) if check_stops else None
            if stopped is not None:
                stopped.start_ms = job._start_ms
                report.finished.append((job, stopped))
                continue
            keep.append(i)
        return keep

    def _keep_rows(self, keep: list[int]) -> None:
        """The batch narrowed to rows ``keep`` (their cache too)."""
        assert self._cache is not None
        self._rows = [self._rows[i] for i in keep]
        width = max(r.length for r in self._rows)
        index = torch.tensor(keep, device=self.bundle.device)
        self._cache = _narrowed(self._cache, index, width, self._text_config)

    def _forward(self, report: _StepReport) -> None:
        """One decode step for every sequence in the batch."""
        assert self._cache is not None
        rows, dev = self._rows, self.bundle.device
        width = max(r.length for r in rows)
        last = torch.tensor([[r.job.seq.tokens[-1]] for r in rows], device=dev)
        # (3, B, 1): each sequence at its own step's position on each M-RoPE axis.
        pos = torch.tensor(
            [r.state.position(len(r.job.seq.tokens) - 1) for r in rows], device=dev
        ).T.unsqueeze(-1)
        kwargs: dict[str, Any] = {self._cache_kw: self._cache}
        if any(r.length != width for r in rows):
            kwargs["attention_mask"] = _padding_mask([r.length for r in rows], width, dev)
        out = self._lm(
            inputs_embeds=self._lm.embed_tokens(last),
            position_ids=pos,
            use_cache=True,
            **kwargs,
        )
        logits = self.bundle.model.lm_head(out.last_hidden_state[:, -1, :]).float()
        self.steps += 1
        for i, r in enumerate(rows):
            r.length += 1
            r.job.seq.accept(self._choose(r.job, logits[i]))
            report.tokens.append((r.job, *r.job.seq.take_new()))

    async def close(self) -> None:
        """Stop the loop; requests still in it are cancelled."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for job in [r.job for r in self._rows] + self._joining:
            if job._future is not None and not job._future.done():
                job._future.cancel()
        self._rows, self._cache, self._joining = [], None, []
        self.lane.shutdown()


def _call_back(report: _StepReport) -> None:
    """The jobs' ``on_started`` and ``on_tokens`` for one step, each in its job's context."""
    for job in report.started:
        if job.on_started is not None:
            _in_context(job, job.on_started)
    for job, tokens, text in report.tokens:
        if job.on_tokens is not None and (tokens or text):
            _in_context(job, job.on_tokens, tokens, text)


def decode_alone(
    bundle: ModelBundle,
    start: Callable[[], Prefilled],
    sampling: SamplingParams,
    *,
    request_id: str = "",
    deadline_ms: int | None = None,
    should_stop: Callable[[], bool] | None = None,
) -> tuple[Finished, DecodeState]:
    """One request decoded alone on the calling thread, through a :class:`DecodeEngine` with
    a batch of one (:meth:`DecodeEngine.run_alone`): ``start`` (its prefill, or a state made
    before), then a step per token. How it ended, and its sequence (tokens, text, finish
    reason)."""
    seq = new_sequence(bundle, sampling, request_id)
    job = DecodeJob(
        request_id, seq, start, kv_tokens=0, deadline_ms=deadline_ms, should_stop=should_stop
    )
    engine = DecodeEngine(bundle, max_batch=1, kv_budget_bytes=sys.maxsize)
    return engine.run_alone(job), seq


def generate_from_embeddings(
    bundle: ModelBundle,
    token_ids: Sequence[int],
    items: Sequence[ItemEmbedding],
    max_tokens: int,
    stop_token_ids: Sequence[int] = (),
    ignore_eos: bool = False,
    *,
    sampling: SamplingParams | None = None,
    request_id: str = "",
) -> list[int]:
    """The split path for one request: precomputed embeddings -> prefill -> decode (a batch of
    one, :func:`decode_alone`) -> its token ids; what :mod:`gpu_workers.oracle` checks.

    Greedy unless ``sampling`` is given (then its own ``max_tokens`` and stops apply, and the
    arguments above them are ignored)."""
    if sampling is None:
        if max_tokens <= 0:
            return []
        sampling = SamplingParams(
            max_tokens=max_tokens, stop_token_ids=list(stop_token_ids), ignore_eos=ignore_eos
        )
    _, seq = decode_alone(
        bundle, lambda: prefill(bundle, token_ids, items), sampling, request_id=request_id
    )
    return seq.tokens


def _narrowed(cache: Any, index: torch.Tensor, width: int, config: Any) -> DynamicCache:
    """The batch's cache with only the rows ``index``, cut to the last ``width`` positions."""
    layers = [
        (k.index_select(0, index)[..., -width:, :], v.index_select(0, index)[..., -width:, :])
        for k, v, *_ in cache
    ]
    return DynamicCache(ddp_cache_data=layers, config=config)


def _padding_mask(lengths: list[int], width: int, device: torch.device) -> torch.Tensor:
    """``(B, width + 1)``: 1 over each row's own positions (its last ``length``) and the step's
    new one, 0 over its left padding."""
    mask = torch.zeros((len(lengths), width + 1), dtype=torch.long, device=device)
    for i, length in enumerate(lengths):
        mask[i, width - length :] = 1
    return mask


def _left_pad(t: torch.Tensor, width: int) -> torch.Tensor:
    """``(B, heads, L, dim)`` padded with zeros on the left to ``width`` positions."""
    pad = width - int(t.shape[-2])
    return t if pad == 0 else torch.nn.functional.pad(t, (0, 0, pad, 0))
