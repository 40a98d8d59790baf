"""The fleet view's pure logic: announcements parsed within bounds, secret fingerprints,
readiness causes, the admin gate and the settings it reads (Redis and the broker are in
tests/integration/test_fleet.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from aiokafka import TopicPartition
from pydantic import ValidationError

from frontend.api.errors import ApiError
from frontend.api.tenants import AdminTokens
from runtime.fleet.announcement import (
    MAX_ANNOUNCEMENT_BYTES,
    Announcement,
    announcement_for,
    secret_fingerprint,
)
from runtime.fleet.announcer import Announcer
from runtime.fleet.board import FleetRead
from runtime.fleet.readiness import Expected, fleet_causes
from runtime.fleet.snapshot import expected_as_configured, expected_of
from runtime.settings import Settings

SECRET = "s" * 40


def _worker(stage: str, worker_id: str | None = None, **changes: object) -> Announcement:
    settings = Settings(ec_secret=SECRET)
    a = announcement_for(settings, stage, worker_id or f"{stage}@h:1", now_ms=1_000)
    data = {**a.to_dict(), "expires_ms": 20_000, **changes}
    return Announcement(**data)  # type: ignore[arg-type]


def test_an_announcement_round_trips_and_bad_entries_are_skipped() -> None:
    a = _worker("prefill", partitions=("epd.prefill:0", "epd.prefill:1"))
    assert Announcement.from_json(a.to_json()) == a
    good = json.loads(a.to_json())
    bad = [
        "not json",
        json.dumps({**good, "in_flight": True}),  # a bool is not a count
        json.dumps({**good, "partitions": [1]}),
        json.dumps({k: v for k, v in good.items() if k != "stage"}),
        json.dumps({**good, "model": "m" * 600}),
        json.dumps({**good, "junk": "x" * MAX_ANNOUNCEMENT_BYTES}),
    ]
    assert [Announcement.from_json(b) for b in bad] == [None] * len(bad)


def test_the_secret_fingerprint_tells_equal_secrets_without_showing_them() -> None:
    one, same, other = (secret_fingerprint(s.encode()) for s in (SECRET, SECRET, "t" * 40))
    assert one == same != other
    assert SECRET[:8] not in one and len(one) == 16
    assert secret_fingerprint(None) == "none"


def test_readiness_names_each_missing_stage_and_each_disagreeing_worker() -> None:
    expected = expected_of(Settings(ec_secret=SECRET))
    live = (
        _worker("encode"),
        _worker("prefill", "prefill@odd:7", ec_secret="0" * 16, model="other/model"),
        _worker("results", ec_secret="", model=""),  # signs nothing, loads no model: no check
    )
    gone = (_worker("router", announced_ms=5_000, expires_ms=9_000),)
    causes = fleet_causes(FleetRead(live, gone), expected, ("router", "decode"), now_ms=10_000)
    assert causes == [
        "no live router worker (last seen 5 s ago: router@h:1)",
        "no live decode worker (none has announced itself)",
        "prefill worker prefill@odd:7 signs with another EC secret than the API's: every "
        "request it handles is refused ec-signature",
        "prefill worker prefill@odd:7 serves model 'other/model'; the API serves "
        f"{expected.model!r}",
    ]
    assert fleet_causes(FleetRead(live[:1], ()), expected, ("encode",), now_ms=10_000) == []
    # No fingerprint in words (/readyz answers anyone); and with no stage required, readiness
    # does not look at the workers at all.
    assert not any(live[1].ec_secret in c or expected.ec_secret in c for c in causes)
    assert fleet_causes(FleetRead(live, gone), expected, (), now_ms=10_000) == []


def test_other_shared_settings_are_a_cause() -> None:
    expected = Expected("m", "fp", "settings-a")
    worker = _worker("results", ec_secret="", model="", settings="settings-b")
    [cause] = fleet_causes(FleetRead((worker,), ()), expected, ("results",), now_ms=10_000)
    assert "other shared settings" in cause


def test_the_admin_gate() -> None:
    AdminTokens({}, api_open=True).check(None)  # an open API without admin tokens
    with pytest.raises(ApiError) as closed:
        AdminTokens({}, api_open=False).check("tenant-token")
    assert closed.value.status == 403 and closed.value.rule == "auth.admin"
    admins = AdminTokens({"ops": "alice"}, api_open=False)
    admins.check("ops")
    for token, status in ((None, 401), ("tenant-token", 403), ("op", 403)):
        with pytest.raises(ApiError) as refused:
            admins.check(token)
        assert refused.value.status == status


def test_ready_stages_and_admin_tokens_are_checked_settings() -> None:
    assert Settings(decode_stage=True).required_stages == ("encode", "prefill", "results", "decode")
    assert Settings(ready_stages="").required_stages == ()
    with pytest.raises(ValidationError, match="unknown stage"):
        Settings(ready_stages="encode,gpu")
    with pytest.raises(ValidationError, match="EPD_ADMIN_TOKENS"):
        Settings(admin_tokens="no-tenant-here")
    assert "ops-token" not in json.dumps(Settings(admin_tokens="ops-token=ops").describe())


def test_a_reader_without_the_secret_or_model_asks_the_workers_to_agree_among_themselves() -> None:
    unknown = Expected(None, None, None)
    agreeing = (_worker("encode"), _worker("prefill"))
    needed = ("encode", "prefill")
    assert fleet_causes(FleetRead(agreeing, ()), unknown, needed, now_ms=10_000) == []
    split = (*agreeing, _worker("router", ec_secret="f" * 16, model="other/model"))
    causes = fleet_causes(FleetRead(split, ()), unknown, needed, now_ms=10_000)
    assert len(causes) == 2, causes
    assert causes[0].startswith("live workers run with 2 different EC secrets (")
    assert causes[1].startswith("live workers run with 2 different models (workers: ")
    assert "other/model: 1" in causes[1] and "f" * 16 not in causes[0]
    # Given the secret, each odd worker is named instead of the split.
    known = Expected(None, agreeing[0].ec_secret, None)
    [named, models] = fleet_causes(FleetRead(split, ()), known, needed, now_ms=10_000)
    assert named.startswith("router worker router@h:1 signs with another EC secret")
    assert models.startswith("live workers run with 2 different models")


def test_epd_status_expects_only_what_its_shell_was_given(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("EPD_MODEL", "EPD_EC_SECRET", "EPD_EC_NAMESPACE", "EPD_DECODE_STAGE"):
        monkeypatch.delenv(name, raising=False)
    assert expected_as_configured(Settings()) == Expected(None, None, None)
    monkeypatch.setenv("EPD_MODEL", "tiny")
    monkeypatch.setenv("EPD_EC_SECRET", SECRET)
    got = expected_as_configured(Settings())
    assert got == Expected("tiny", secret_fingerprint(SECRET.encode()), None)


class _Loop:
    def __init__(self) -> None:
        self.in_flight, self.processed, self.dead_lettered = 2, 0, 0
        self.failure: BaseException | None = None

    def assignment(self) -> set[TopicPartition]:
        return {TopicPartition("epd.encode", 1), TopicPartition("epd.encode", 0)}


class _Board:
    def __init__(self, fail: bool = False) -> None:
        self.written: list[Announcement] = []
        self.fail = fail

    async def announce(self, a: Announcement) -> None:
        if self.fail:
            raise ConnectionError("Redis away")
        self.written.append(a)


async def test_the_announcer_counts_and_beats_while_the_loop_runs(tmp_path: Path) -> None:
    loop, board, now = _Loop(), _Board(), [100.0]
    identity = announcement_for(Settings(ec_secret=SECRET), "encode", "encode@h:1", 0)
    beat = tmp_path / "beat"
    announcer = Announcer(
        board, identity, loop, interval_s=5, ttl_s=15, heartbeat_file=beat, clock=lambda: now[0]
    )  # type: ignore[arg-type]
    await announcer.beat()
    first = board.written[-1]
    assert first.partitions == ("epd.encode:0", "epd.encode:1") and first.in_flight == 2
    assert first.last_handled_ms is None and first.expires_ms == 115_000 and beat.exists()
    loop.processed, loop.dead_lettered, now[0] = 3, 1, 101.0
    await announcer.beat()
    assert (board.written[-1].handled, board.written[-1].last_handled_ms) == (4, 101_000)
    now[0] = 102.0
    await announcer.beat()  # nothing handled since: the last handled time stays
    assert board.written[-1].last_handled_ms == 101_000
    # A failed loop stops the heartbeat (the probe restarts the pod); Redis away does not.
    beat.unlink()
    announcer.board = _Board(fail=True)  # type: ignore[assignment]
    await announcer.beat()
    assert beat.exists()
    beat.unlink()
    loop.failure = RuntimeError("consume loop died")
    await announcer.beat()
    assert not beat.exists()


async def test_callers_at_one_moment_share_one_snapshot(monkeypatch: pytest.MonkeyPatch) -> None:
    """A scraper hammering /metrics costs the broker and Redis one read a second, not one per
    scrape (each queued behind the offsets' lock)."""
    import asyncio
    from types import SimpleNamespace

    from runtime.fleet import snapshot as snapshot_mod
    from runtime.fleet.snapshot import FleetProbe
    from schemas.keys import RedisKeys
    from schemas.topics import Topics

    status = SimpleNamespace(client=None, keys=RedisKeys("epd"))
    probe = FleetProbe(Settings(ec_secret=SECRET), Topics("epd"), status)  # type: ignore[arg-type]
    reads = []

    async def slow_read(*, kafka: bool = True) -> object:
        reads.append(kafka)
        await asyncio.sleep(0.05)
        return object()

    monkeypatch.setattr(probe, "snapshot", slow_read)
    clock = [10.0]
    probe.clock = lambda: clock[0]
    got = await asyncio.gather(*(probe.recent() for _ in range(20)))
    assert len(reads) == 1 and len({id(g) for g in got}) == 1
    clock[0] += snapshot_mod.SHARED_FOR_S + 0.1
    assert await probe.recent() is not got[0] and len(reads) == 2
