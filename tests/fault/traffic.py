"""Traffic for the fault tests: a stream of requests on the real pipeline, and what became of it.

Requests go alternately through the Submitter's fan-out and through the render topic and the
router; a fault runs while they keep coming. :func:`outcomes` reads each request's terminal status
record, :func:`terminal_results` the terminal events on the durable results topic.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable

from bench.worker_profile import rss_mb
from epd.local_pipeline import LocalRun
from media.sample_images import synthetic_image
from runtime.kafka import KafkaPublisher, read_topic
from schemas.codec import decode
from schemas.status_record import StatusRecord
from schemas.types import TERMINAL_STATUSES, DeadLetter, RenderEvent, ResultEvent, SamplingParams

WAIT_S = 180.0


def worker_rss(run: LocalRun) -> dict[str, float]:
    assert run.workers is not None
    out = {}
    for i, (kind, proc, _) in enumerate(run.workers.procs):
        if proc.poll() is None:
            out[f"{kind}-{i}"] = round(rss_mb(proc.pid) or 0.0, 1)
    return out


async def render_one(run: LocalRun, seed: int, salt: str) -> RenderEvent:
    return await run.submitter.renderer.render_async(
        f"fault-{uuid.uuid4().hex[:10]}",
        prompt="Describe <image>.",
        images=[synthetic_image(56 + 14 * (seed % 3), 70, seed=seed)],
        sampling=SamplingParams(max_tokens=3),
        cache_salt=salt,
    )


async def stream(
    run: LocalRun,
    n: int,
    *,
    every_s: float,
    fault_after: int,
    fault: Callable[[], Awaitable[None]],
    render_only: bool = False,
) -> list[str]:
    """Send ``n`` requests, one every ``every_s`` (alternately through the Submitter's fan-out and
    through the render topic and the router; ``render_only``: all through the router), running
    ``fault`` after ``fault_after`` of them while the rest keep coming. Returns the request ids."""
    salt = uuid.uuid4().hex
    sent: list[str] = []
    fault_task: asyncio.Task[None] | None = None
    for i in range(n):
        if i == fault_after:
            fault_task = asyncio.create_task(fault())
        ev = await render_one(run, 500 + i, salt)
        if i % 2 and not render_only:
            await run.submitter.submit_rendered(ev)
        else:
            topic = f"{run.settings.topic_prefix}.render"
            await KafkaPublisher(run.publisher.producer).send(topic, ev.request_id, ev)
        sent.append(ev.request_id)
        await asyncio.sleep(every_s)
    if fault_task is not None:
        await fault_task
    return sent


async def outcomes(run: LocalRun, ids: list[str]) -> dict[str, dict]:
    """Every request's terminal record (TimeoutError for one that never ends: a lost request)."""
    recs = await asyncio.gather(
        *(run.submitter.wait(r, timeout_s=WAIT_S) for r in ids), return_exceptions=True
    )
    pairs = zip(ids, recs, strict=True)
    return {
        r: (
            rec.to_dict()
            if isinstance(rec, StatusRecord)
            else {"status": "lost", "error": repr(rec)[:200]}
        )
        for r, rec in pairs
    }


async def outcomes_records_may_lose(run: LocalRun, ids: list[str]) -> dict[str, dict]:
    """Every request's outcome where a fault may take status records with it (a failover
    that lost a master's last writes): its terminal record, or for one whose record went (no
    update makes it again) the terminal ``ResultEvent`` on the results topic, as
    ``{"status", "error": {"code"}}``; ``lost`` for one that has neither."""
    results = await terminal_results(run, ids, WAIT_S)
    out: dict[str, dict] = {}
    for r in ids:
        rec = await run.submitter.status.get(r)
        if rec is not None and rec.terminal:
            out[r] = rec.to_dict()
        elif r in results:
            ev = results[r][-1]
            error = None if ev.error is None else {"code": ev.error.code}
            out[r] = {"status": ev.status, "error": error, "record": rec is not None}
        else:
            out[r] = {"status": "lost", "error": "no terminal record or result"}
    return out


def figures(name: str, ids: list[str], got: dict[str, dict], **extra: object) -> dict:
    done = [r for r in ids if got[r]["status"] == "completed"]
    lost = [r for r in ids if got[r]["status"] == "lost"]
    fig = {
        "fault": name,
        "sent": len(ids),
        "completed": len(done),
        "lost": len(lost),
        "other": {r: got[r]["status"] for r in ids if r not in done and r not in lost},
        "lost_errors": sorted({got[r].get("error", "") for r in lost}),
        **extra,
    }
    print(f"\nfault figures: {fig}")
    return fig


async def terminal_results(
    run: LocalRun, ids: list[str], timeout_s: float
) -> dict[str, list[ResultEvent]]:
    """The terminal ResultEvents of ``ids`` on the results topic (durable, unlike the status
    records a Redis restart wipes), once each has one or ``timeout_s`` is over."""
    topic = f"{run.settings.topic_prefix}.results"
    wanted = set(ids)
    deadline = time.monotonic() + timeout_s
    while True:
        found: dict[str, list[ResultEvent]] = {}
        for rec in await read_topic(run.settings, topic):
            ev = decode(rec.value)
            if isinstance(ev, ResultEvent) and ev.request_id in wanted:
                if ev.status in TERMINAL_STATUSES:
                    found.setdefault(ev.request_id, []).append(ev)
        if set(found) == wanted or time.monotonic() >= deadline:
            return found
        await asyncio.sleep(0.5)


async def dead_letters_of(run: LocalRun, ids: list[str]) -> list[DeadLetter]:
    """Dead letters whose original event belongs to one of ``ids`` (valid traffic: must be none)."""
    wanted = set(ids)
    out = []
    for rec in await read_topic(run.settings, f"{run.settings.topic_prefix}.dlq"):
        letter = decode(rec.value, DeadLetter)
        try:
            rid = getattr(decode(letter.value), "request_id", None) if letter.value else None
        except Exception:
            rid = None
        if rid is None:
            rid = (letter.key or b"").decode(errors="replace")
        if rid in wanted:
            out.append(letter)
    return out
