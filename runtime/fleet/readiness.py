"""Whether the fleet can serve what the API admits, in words an operator can act on.

Pure logic over one :class:`~runtime.fleet.board.FleetRead`: ``/readyz`` answers 503 with these
causes, and ``epd status`` prints them.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from runtime.fleet.announcement import Announcement
from runtime.fleet.board import FleetRead

MODEL_STAGES = frozenset({"router", "encode", "prefill", "decode"})
"""Stages whose work depends on the model (the router renders for it)."""
SIGNING_STAGES = frozenset({"router", "encode", "prefill", "decode"})
"""Stages that sign or verify ``ec_transfer_params`` with the EC secret."""


@dataclass(frozen=True, slots=True)
class Expected:
    """What the API serves with: every worker must agree. A field that is None is not known
    to the reader (``epd status`` run without the secret, say): the live workers must then
    agree among themselves on it."""

    model: str | None
    ec_secret: str | None
    settings: str | None


def mismatches(worker: Announcement, expected: Expected) -> list[tuple[str, str]]:
    """``(reason, cause)`` per way ``worker`` disagrees with ``expected`` (reason: ec_secret,
    model or settings)."""
    out: list[tuple[str, str]] = []
    who = f"{worker.stage} worker {worker.worker_id}"
    secret = expected.ec_secret
    if worker.stage in SIGNING_STAGES and secret is not None and worker.ec_secret != secret:
        out.append(
            (
                "ec_secret",
                # No fingerprint in words: /readyz answers anyone, and a digest of the secret
                # is for the admin route (epd status --json), not for guessing against.
                f"{who} signs with another EC secret than the API's: every request it "
                "handles is refused ec-signature",
            )
        )
    model = expected.model
    if worker.stage in MODEL_STAGES and model is not None and worker.model != model:
        out.append(
            ("model", f"{who} serves model {worker.model!r}; the API serves {expected.model!r}")
        )
    if expected.settings is not None and worker.settings != expected.settings:
        out.append(
            (
                "settings",
                f"{who} runs with other shared settings (EPD_EC_NAMESPACE or "
                "EPD_DECODE_STAGE differ from the API's)",
            )
        )
    return out


def fleet_causes(
    fleet: FleetRead, expected: Expected, required: Sequence[str], now_ms: int
) -> list[str]:
    """Why the fleet cannot serve (empty: it can): a required stage without a live worker
    (with when one was last heard of), and every live worker that disagrees with the API."""
    if not required:
        return []  # EPD_READY_STAGES empty: readiness does not look at the workers
    causes: list[str] = []
    for stage in required:
        if fleet.by_stage(stage):
            continue
        last = fleet.last_seen(stage)
        if last is None:
            causes.append(f"no live {stage} worker (none has announced itself)")
        else:
            ago = max(0, now_ms - last.announced_ms) / 1000
            causes.append(f"no live {stage} worker (last seen {ago:.0f} s ago: {last.worker_id})")
    for worker in fleet.live:
        causes.extend(cause for _, cause in mismatches(worker, expected))
    causes.extend(disagreements(fleet, expected))
    return causes


def disagreements(fleet: FleetRead, expected: Expected) -> list[str]:
    """For each property the reader does not know itself, the live workers split over more
    than one value of it (they cannot all serve the same requests)."""
    # (what, the reader's own value, the stages it matters to, the worker's, whether the
    # values may be named: a model may, a digest of the secret is for the admin route only)
    checks = (
        ("EC secrets", expected.ec_secret, SIGNING_STAGES, lambda a: a.ec_secret, False),
        ("models", expected.model, MODEL_STAGES, lambda a: a.model, True),
        ("shared settings", expected.settings, None, lambda a: a.settings, False),
    )
    out = []
    for what, known, stages, value, named in checks:
        if known is not None:
            continue
        counts = Counter(value(a) for a in fleet.live if stages is None or a.stage in stages)
        if len(counts) > 1:
            split = ", ".join(f"{v}: {n}" if named else str(n) for v, n in counts.most_common())
            out.append(
                f"live workers run with {len(counts)} different {what} (workers: {split}; "
                "epd status --json names them)"
            )
    return out
