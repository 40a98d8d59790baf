"""Whether the fleet can serve what the API admits, in words an operator can act on.

Pure logic over one :class:`~runtime.fleet.board.FleetRead`: ``/readyz`` answers 503 with these
causes, and ``epd status`` prints them.
"""

from __future__ import annotations

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
    """What the API serves with: every worker must agree."""

    model: str
    ec_secret: str
    settings: str


def mismatches(worker: Announcement, expected: Expected) -> list[tuple[str, str]]:
    """``(reason, cause)`` per way ``worker`` disagrees with ``expected`` (reason: ec_secret,
    model or settings)."""
    out: list[tuple[str, str]] = []
    who = f"{worker.stage} worker {worker.worker_id}"
    if worker.stage in SIGNING_STAGES and worker.ec_secret != expected.ec_secret:
        out.append(
            (
                "ec_secret",
                f"{who} signs with another EC secret (fingerprint {worker.ec_secret}; the "
                f"API's is {expected.ec_secret}): every request it handles is refused "
                "ec-signature",
            )
        )
    if worker.stage in MODEL_STAGES and worker.model != expected.model:
        out.append(
            ("model", f"{who} serves model {worker.model!r}; the API serves {expected.model!r}")
        )
    if worker.settings != expected.settings:
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
    return causes
