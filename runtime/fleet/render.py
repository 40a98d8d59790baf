"""A :class:`~runtime.fleet.snapshot.FleetSnapshot` in plain text (``epd status``)."""

from __future__ import annotations

from collections import defaultdict

from runtime.fleet.announcement import Announcement
from runtime.fleet.snapshot import FleetSnapshot
from schemas.topics import STAGE_NAMES


def render_snapshot(snap: FleetSnapshot, required: tuple[str, ...]) -> str:
    """The fleet as an operator reads it: readiness, workers per stage, each worker, lag per
    group and partition, dead letters, requests by status, store memory."""
    lines = ["ready" if not snap.causes else "NOT READY"]
    lines += [f"  - {cause}" for cause in snap.causes]
    lines += _stages(snap, required)
    lines += _workers(snap.fleet.live, snap.taken_ms)
    lines += _lag(snap)
    lines.append("requests  " + _counts(snap.requests))
    if snap.store is not None:
        limit = f"{snap.store.max_bytes / 2**20:.0f} MiB" if snap.store.max_bytes else "no limit"
        lines.append(f"store     {snap.store.used_bytes / 2**20:.1f} MiB used, {limit}")
    lines += [f"cannot read {part}: {why}" for part, why in snap.errors.items()]
    return "\n".join(lines)


def _stages(snap: FleetSnapshot, required: tuple[str, ...]) -> list[str]:
    out = ["", "stage     workers  in flight  partitions"]
    for stage in STAGE_NAMES:
        live = snap.fleet.by_stage(stage)
        if not live and stage not in required:
            continue
        held = sum(len(a.partitions) for a in live)
        busy = sum(a.in_flight for a in live)
        out.append(f"{stage:<9} {len(live):>7}  {busy:>9}  {held:>10}")
    return out


def _workers(live: tuple[Announcement, ...], now_ms: int) -> list[str]:
    out = ["", "worker" + " " * 34 + "model / engine / version"]
    for a in live:
        last = (
            "never"
            if a.last_handled_ms is None
            else f"{(now_ms - a.last_handled_ms) / 1000:.0f} s ago"
        )
        what = f"{a.model or '-'} / {a.engine or '-'} / {a.version}"
        out.append(f"{a.worker_id:<40}{what}")
        out.append(
            f"    holds {_held(a.partitions)}; {a.in_flight} in flight, "
            f"{a.handled} handled, last {last}"
        )
    if not live:
        out.append("(no live worker)")
    return out


def _held(partitions: tuple[str, ...]) -> str:
    by_topic: dict[str, list[str]] = defaultdict(list)
    for tp in partitions:
        topic, _, part = tp.rpartition(":")
        by_topic[topic].append(part)
    return ", ".join(f"{t} [{','.join(p)}]" for t, p in by_topic.items()) or "no partition"


def _lag(snap: FleetSnapshot) -> list[str]:
    if snap.offsets is None:
        return []
    out = ["", "group / topic / partition: lag (committed / end)"]
    for p in snap.offsets.lag:
        committed = "-" if p.committed is None else str(p.committed)
        out.append(f"{p.group} / {p.topic} / {p.partition}: {p.lag} ({committed} / {p.end})")
    out.append("")
    out += [f"dead letters  {topic}: {n}" for topic, n in snap.offsets.dlq_records.items()]
    return out


def _counts(counts: dict[str, int]) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(counts.items())) or "none unfinished"
