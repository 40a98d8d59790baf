"""Scale-out on the real pipeline: two workers of every kind sharing partitions.

One pipeline (broker, Redis, eight worker processes: two results collectors, two encode, two
prefill, two routers) serves the whole module, in file order: the work is shared, a burst far
beyond what the workers do at once drains without loss or duplicates, then one worker of each
kind in turn (encode, prefill, results, router) is killed with SIGKILL mid-stream and NOT
restarted: the survivor of its group must take over the dead worker's partitions once the
session timeout expires, and every request must still finish with exactly one terminal status
(a killed results collector's uncommitted records are folded again by the survivor). The kill
tests come last because they leave the pipeline with fewer workers.

Each test prints its figures (sent, completed, lost, duplicated, worker RSS before/after) and
bounds its own time.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
import uuid
from collections import defaultdict
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from epd.local_pipeline import LocalRun, local_pipeline
from media.sample_images import synthetic_image
from runtime.kafka import read_topic
from runtime.settings import Settings
from schemas.codec import get_codec
from schemas.status_record import StatusRecord
from schemas.types import TERMINAL_STATUSES, ResultEvent, SamplingParams
from tests.fault.test_faults import dead_letters_of, figures, stream, worker_rss

pytestmark = [pytest.mark.integration, pytest.mark.slow]

KINDS = ("results", "results", "encode", "encode", "prefill", "prefill", "router", "router")
TOPIC_OF = {"encode": "encode", "prefill": "prefill", "results": "results", "router": "render"}
"""The topic whose partitions each kind's consumer group shares."""
WAIT_S = 90.0
"""Longest any request may take to finish (a rebalance after a kill takes the session timeout,
6 s on Tansu, plus the join)."""

_HANDLED = re.compile(r"handled (\S+)\[(\d+)\]@(\d+)")


@pytest.fixture(scope="module")
async def pipeline(
    settings: Settings, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[LocalRun]:
    log_dir: Path = tmp_path_factory.mktemp("scaleout-logs")
    # The workers' "handled" lines (DEBUG) say which member took which record.
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("EPD_LOG_LEVEL", "DEBUG")
        async with local_pipeline(
            settings, spawn_workers=True, log_dir=log_dir, kinds=KINDS
        ) as run:
            yield run


def _log_messages(path: Path) -> list[str]:
    """The ``msg`` of every JSON line of a worker log (non-JSON lines are skipped)."""
    out = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict) and isinstance(rec.get("msg"), str):
            out.append(rec["msg"])
    return out


def handled(run: LocalRun, index: int, topic: str) -> set[tuple[int, int]]:
    """(partition, offset) of every ``topic`` record worker ``index`` logged as handled."""
    assert run.workers is not None
    _, _, log_path = run.workers.procs[index]
    found = set()
    for msg in _log_messages(log_path):
        m = _HANDLED.search(msg)
        if m and m.group(1) == topic:
            found.add((int(m.group(2)), int(m.group(3))))
    return found


async def handled_counts(
    run: LocalRun, kinds: tuple[str, ...], at_least: int, timeout_s: float = 15.0
) -> dict[str, int]:
    """``{"<kind>-<index>": records handled}`` per worker of ``kinds``, once each kind's workers
    logged ``at_least`` records between them (or ``timeout_s`` passed). A worker logs a record
    as handled after its handler returned, which is after the result it published, so a
    request can be seen completed a moment before its last line is written."""
    assert run.workers is not None
    prefix = run.settings.topic_prefix
    deadline = time.monotonic() + timeout_s
    while True:
        counts = {
            f"{kind}-{i}": len(handled(run, i, f"{prefix}.{kind}"))
            for kind in kinds
            for i in run.workers.indices(kind)
        }
        totals = [sum(counts[f"{kind}-{i}"] for i in run.workers.indices(kind)) for kind in kinds]
        if min(totals) >= at_least or time.monotonic() >= deadline:
            return counts
        await asyncio.sleep(0.1)


def last_assignment(run: LocalRun, index: int, topic: str) -> set[int]:
    """The partitions of ``topic`` in worker ``index``'s latest ``assigned`` log line."""
    assert run.workers is not None
    _, _, log_path = run.workers.procs[index]
    lines = [m for m in _log_messages(log_path) if ": assigned " in m and topic in m]
    if not lines:
        return set()
    return {int(p) for p in re.findall(rf"topic='{re.escape(topic)}', partition=(\d+)", lines[-1])}


def others_alive(run: LocalRun, dead: set[int]) -> None:
    """Every worker except those in ``dead`` is still running (log tail in the message)."""
    assert run.workers is not None
    for i, (kind, proc, log_path) in enumerate(run.workers.procs):
        if i not in dead and proc.poll() is not None:
            tail = log_path.read_text(errors="replace")[-3000:]
            raise AssertionError(f"{kind}-{i} exited with {proc.returncode}; log tail:\n{tail}")


async def outcomes(run: LocalRun, ids: list[str]) -> dict[str, dict]:
    """Every request's terminal record; ``{"status": "lost"}`` for one that never ends."""
    recs = await asyncio.gather(
        *(run.submitter.wait(r, timeout_s=WAIT_S) for r in ids), return_exceptions=True
    )
    pairs = zip(ids, recs, strict=True)
    return {
        r: (rec.to_dict() if isinstance(rec, StatusRecord) else {"status": "lost"})
        for r, rec in pairs
    }


async def duplicates(run: LocalRun, ids: list[str], got: dict[str, dict]) -> dict[str, object]:
    """Requests with more than one outcome, seen three ways.

    - the results topic: two *different* terminal statuses for one request (a redelivered copy of
      the same outcome is at-least-once delivery and is only counted, as ``redelivered``);
    - the status record: not exactly one terminal (stage, status) pair folded into it;
    - the request's status-event stream: not exactly one terminal change announced to clients.
    """
    codec = get_codec()
    wanted = set(ids)
    terminal: dict[str, list[str]] = defaultdict(list)
    topic = f"{run.settings.topic_prefix}.results"
    for rec in await read_topic(run.settings, topic):
        ev = codec.decode(rec.value, ResultEvent)
        if ev.request_id in wanted and ev.status in TERMINAL_STATUSES:
            terminal[ev.request_id].append(ev.status)
    status = run.submitter.status
    in_topic = [r for r in ids if len(set(terminal[r])) > 1]
    in_record = []
    in_stream = []
    for r in ids:
        pairs = [k for k in got[r].get("stages", {}) if k.split(":", 1)[1] in TERMINAL_STATUSES]
        if len(pairs) != 1 and got[r]["status"] != "lost":  # exactly one outcome folded in
            in_record.append(r)
        entries: list[Any] = await status.client.xrange(status.keys.status_events(r)) or []
        data = [fields.get(b"data") or fields.get("data") for _, fields in entries]
        ends = [d for d in data if json.loads(d)["status"] in TERMINAL_STATUSES]
        if len(ends) != 1 and got[r]["status"] != "lost":
            in_stream.append(r)
    return {
        "duplicated": len(set(in_topic) | set(in_record) | set(in_stream)),
        "dup_detail": {"topic": in_topic, "record": in_record, "stream": in_stream},
        "no_outcome_in_topic": sum(1 for r in ids if not terminal[r]),
        "redelivered": sum(max(0, len(terminal[r]) - 1) for r in ids),
    }


async def test_two_encode_and_two_prefill_workers_share_the_work(pipeline: LocalRun) -> None:
    run = pipeline
    assert run.workers is not None
    before = worker_rss(run)

    async def no_fault() -> None:
        return None

    t0 = time.monotonic()
    ids = await stream(run, 16, every_s=0.05, fault_after=-1, fault=no_fault)
    got = await asyncio.wait_for(outcomes(run, ids), WAIT_S + 30)
    per_worker = await handled_counts(run, ("encode", "prefill"), at_least=len(ids))
    dup = await duplicates(run, ids, got)
    fig = figures(
        "two encode + two prefill workers",
        ids,
        got,
        **dup,
        handled=per_worker,
        seconds=round(time.monotonic() - t0, 1),
        rss_before=before,
        rss_after=worker_rss(run),
    )
    run.workers.check_alive()
    assert fig["completed"] == fig["sent"], fig
    assert fig["duplicated"] == 0, fig
    # 16 requests with distinct images (so distinct encode keys) over 4 partitions, 2 per worker:
    # one worker getting nothing is a 2 * 2**-16 chance for encode (the same for prefill).
    assert all(n > 0 for n in per_worker.values()), fig
    # Every encode/prefill record was handled by one worker or the other (none skipped).
    assert sum(per_worker[f"encode-{i}"] for i in run.workers.indices("encode")) >= len(ids)
    assert sum(per_worker[f"prefill-{i}"] for i in run.workers.indices("prefill")) >= len(ids)


async def test_burst_of_60_at_once_completes_without_duplicates(pipeline: LocalRun) -> None:
    run = pipeline
    assert run.workers is not None
    n = 60
    salt = uuid.uuid4().hex
    before = worker_rss(run)
    t0 = time.monotonic()

    async def one(i: int) -> str:
        ev, _ = await run.submitter.submit(
            prompt="Describe <image>.",
            images=[synthetic_image(56 + 14 * (i % 3), 70, seed=2000 + i)],
            sampling=SamplingParams(max_tokens=3),
            cache_salt=salt,
            request_id=f"burst-{uuid.uuid4().hex[:10]}",
        )
        return ev.request_id

    ids = list(await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(n))), 60))
    submitted_s = round(time.monotonic() - t0, 1)
    got = await asyncio.wait_for(outcomes(run, ids), WAIT_S + 30)
    seconds = round(time.monotonic() - t0, 1)
    dup = await duplicates(run, ids, got)
    fig = figures(
        f"burst of {n} at once",
        ids,
        got,
        **dup,
        submitted_s=submitted_s,
        seconds=seconds,
        rss_before=before,
        rss_after=worker_rss(run),
    )
    run.workers.check_alive()
    assert fig["completed"] == fig["sent"] == n, fig
    assert fig["duplicated"] == 0, fig
    assert fig["no_outcome_in_topic"] == 0, fig


@pytest.mark.parametrize("kind", ["encode", "prefill", "results", "router"])
async def test_kill_9_one_of_two_workers_mid_stream_survivor_takes_over(
    pipeline: LocalRun, kind: str
) -> None:
    run = pipeline
    assert run.workers is not None
    topic = f"{run.settings.topic_prefix}.{TOPIC_OF[kind]}"
    dead = {i for i, (_, proc, _) in enumerate(run.workers.procs) if proc.poll() is not None}
    victim, survivor = run.workers.indices(kind)
    before = worker_rss(run)
    orphaned = last_assignment(run, victim, topic)
    assert orphaned, "the victim held no partitions before the kill"
    survivor_before = handled(run, survivor, topic)
    t0 = time.monotonic()
    killed_at: list[float] = []

    async def fault() -> None:
        assert run.workers is not None
        await asyncio.sleep(0.3)
        assert run.workers.kill(victim) == -9  # and never restarted
        killed_at.append(time.monotonic() - t0)

    # ~5 s of steady traffic: most of it arrives after the kill, while the dead worker's
    # partitions are orphaned (until the session timeout) and then reassigned.
    # All through the render topic when the router is the victim, so its orphaned partitions
    # surely get records (half the traffic would leave a ~1% chance they get none).
    ids = await stream(
        run, 20, every_s=0.25, fault_after=4, fault=fault, render_only=kind == "router"
    )
    got = await asyncio.wait_for(outcomes(run, ids), WAIT_S + 30)
    # The outcome can be on the record before the survivor has taken over (the prefill worker
    # writes it through; the results topic is folded again later): wait for the takeover.
    everything = set(range(run.settings.topic_partitions))
    taken_over: set = set()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        taken_over = {
            po for po in handled(run, survivor, topic) - survivor_before if po[0] in orphaned
        }
        if taken_over and last_assignment(run, survivor, topic) == everything:
            break
        await asyncio.sleep(0.5)
    dup = await duplicates(run, ids, got)
    letters = await dead_letters_of(run, ids)
    fig = figures(
        f"kill -9 one of two {kind} workers, no restart",
        ids,
        got,
        **dup,
        killed_at_s=round(killed_at[0], 1) if killed_at else None,
        seconds=round(time.monotonic() - t0, 1),
        orphaned_partitions=sorted(orphaned),
        survivor_partitions=sorted(last_assignment(run, survivor, topic)),
        taken_over_records=len(taken_over),
        in_dlq=len(letters),
        rss_before=before,
        rss_after=worker_rss(run),
    )
    others_alive(run, dead | {victim})
    assert fig["completed"] == fig["sent"], fig
    assert fig["duplicated"] == 0, fig
    assert fig["in_dlq"] == 0, fig
    # The survivor now owns every partition of the topic: the dead worker's share moved to it.
    assert last_assignment(run, survivor, topic) == everything, fig
    # ...and handled records there (about 14 requests sent after the kill, each with several
    # records for the results topic, all missing the two orphaned partitions is a 2**-14 chance).
    assert fig["taken_over_records"] > 0, fig
