"""An idle consume loop sleeps (consumers.idle); the aiokafka internals it leans on are there."""

from __future__ import annotations

import inspect

from aiokafka import AIOKafkaConsumer
from aiokafka.consumer.fetcher import Fetcher

from consumers.idle import FetchParams, IdleFetch, PollPace
from runtime.kafka import FETCHER_TIMEOUT_MS, make_consumer, set_fetch
from runtime.settings import Settings


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_poll_waits_long_only_when_nothing_is_owed() -> None:
    pace = PollPace(busy_ms=200, idle_ms=1000)
    assert pace.timeout_ms(busy=True) == 200
    assert pace.timeout_ms(busy=False) == 1000
    assert PollPace(busy_ms=500, idle_ms=100).timeout_ms(busy=False) == 500


def test_a_quiet_loop_backs_off_to_the_idle_fetch_and_the_first_record_brings_it_back() -> None:
    clock = Clock()
    active = FetchParams(wait_ms=100, min_bytes=16384)
    idle = IdleFetch(active, idle_wait_ms=5000, idle_after_s=5.0, clock=clock)
    assert idle.current == active
    clock.now += 4.9
    assert idle.observe(busy=False) is None  # not quiet for long enough yet
    clock.now += 0.2
    assert idle.observe(busy=False) == FetchParams(5000, 1)  # waits for the first record
    assert idle.observe(busy=False) is None  # already there
    assert idle.observe(busy=True) == active
    clock.now += 3
    assert idle.observe(busy=False) is None  # quiet counts again from the last record
    assert idle.switches == 2


def test_no_idle_fetch_when_it_would_not_wait_longer() -> None:
    clock = Clock()
    idle = IdleFetch(FetchParams(500), idle_wait_ms=500, idle_after_s=0.0, clock=clock)
    clock.now += 60
    assert idle.observe(busy=False) is None
    assert idle.current == FetchParams(500)


def test_the_fetcher_still_reads_what_set_fetch_changes() -> None:
    """set_fetch writes two private attributes of aiokafka's fetcher: the fetcher must still set
    them and read them when it builds each fetch request (aiokafka 0.14)."""
    init = inspect.getsource(Fetcher.__init__)
    build = inspect.getsource(Fetcher._get_actions_per_node)
    for name in ("_fetch_max_wait_ms", "_fetch_min_bytes"):
        assert f"self.{name} =" in init, name
        assert f"self.{name}" in build, name

    class Started:
        _fetcher = Fetcher.__new__(Fetcher)

    started = Started()
    started._fetcher._fetch_max_wait_ms = 500
    started._fetcher._fetch_min_bytes = 1
    assert set_fetch(started, wait_ms=5000, min_bytes=1)  # type: ignore[arg-type]
    assert started._fetcher._fetch_max_wait_ms == 5000


async def test_set_fetch_refuses_a_consumer_without_a_fetcher() -> None:
    consumer = AIOKafkaConsumer(bootstrap_servers="127.0.0.1:1")  # never started
    assert not set_fetch(consumer, wait_ms=5000, min_bytes=1)


async def test_consumers_wake_their_fetcher_rarely() -> None:
    """aiokafka's fetch routine wakes every 200 ms by default with nothing to do."""
    consumer = make_consumer(Settings(), group_id=None)
    assert consumer._consumer_timeout == FETCHER_TIMEOUT_MS / 1000
    assert "fetcher_timeout=self._consumer_timeout" in inspect.getsource(AIOKafkaConsumer.start)
