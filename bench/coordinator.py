"""The coordinator's own cost: the whole stack on the instant engine, through the HTTP API.

``EPD_MODEL=instant`` (``gpu_workers/instant.py``) runs every stage for real (the API's render
with the tiny Qwen2-VL's processor, the fan-out, the claim check, the encode stage and its store
entry, prefill admission and the embedding wait, the decode batch's bookkeeping, token streams,
status records) with the model taken out, so what a request costs here is what the coordinator
costs. Measured on **both embedded brokers**, one after the other (Apache Kafka 4.4 and Tansu,
``epd.services``, each on a fresh data directory with a Redis of its own where ``redis-server``
is installed; ``EPD_BENCH_BROKERS`` picks them as for ``pipeline``). For each broker the stack
``epd stack`` runs is started as processes: the topics, the results, encode, prefill and router
workers (``epd worker``) and ``epd api``; then requests go through the HTTP API with the Python
client (``frontend.client.EPDClient.run``: a multipart submit that holds the answer until the
request has finished, ``POST /v1/requests?wait=``; a stack without it answers at once, and the
client then long-polls ``GET /v1/requests/{id}?wait=`` until the status is terminal), each a
224x224 PNG (``media.sample_images.synthetic_image``, 1.2 MB of fp32 pixels once rendered:
claim-checked) and ``MAX_TOKENS`` new tokens, in four cells:

- ``new``: a new image every request (the encode stage runs), and ``cached``: one image over
  and over (an encoder-cache hit: no encode event), each at concurrency 1 and 16 (that many
  client lanes, each submitting its next request when its last one finished).

Per cell: requests/s (requests / wall), latency p50/p99 (submit to the client seeing the
terminal status), stack CPU ms per request by process (``/proc/<pid>/stat`` of the API, each
worker, the broker and Redis, over the cell), the benchmark client's own CPU apart, Kafka
records per request (end-offset deltas summed over the run's topics, by topic; offset commits
are not counted), Redis commands per request (``INFO commandstats`` deltas; the top commands by
count with their server-side microseconds). Per stack: RSS (judged) and PSS per process after
the cells, idle stack CPU (% of one core, together and per process, the broker's by thread)
over ``idle_s`` with no traffic once the stack settled (:func:`idle`; the seconds before are
reported apart), each process's Redis commands for one request of each case (``MONITOR``), and
py-spy profiles of the API and the workers during a second, profiled run of each concurrency-16 cell
(the measured cells run without py-spy, which would take CPU from the two cores they share).

**The critical-path floor.** In the same run, with the stack idle: the bare broker hop
(``bench.pipeline._kafka_hop``: a PrefillEvent's bytes produced with acks=all by the workers'
producer and read by a consumer with the workers' fetch settings, to a handler task starting;
p50) and the bare Redis figures: a round trip (``PING``) and a notification (``PUBLISH`` on one
connection -> the message read on a subscribed one), p50. A new image's critical path is
API -> encode topic -> encode worker -> store put, whose notification wakes the prefill worker
(which has its own prefill-topic hop meanwhile, in parallel) -> the status record write, whose
notification wakes the API's long-poll; a cached image's is API -> prefill topic -> prefill
worker -> the status record and its notification. No results-topic hop is on either path: each
stage writes its outcome through to the status record (``runtime/reporting.py``), and the
collector folds the results topic off the path. So

- ``floor.new`` = one broker hop + two Redis notifications (the store's, the status record's);
- ``floor.cached`` = one broker hop + one Redis notification (the status record's);

and ``overhead_vs_floor_ms`` = latency p50 at concurrency 1 (all of it overhead: the engine
computes nothing) minus the floor. The HTTP round trips (the submit's POST and the long-poll's
answer) are the API's, so they are overhead, not floor; ``api_healthz_rtt_ms`` (``GET
/healthz``) shows what the bare HTTP server costs beside it.

``tiny_model``: the same cells with ``EPD_MODEL=tiny`` (the tiny model's real compute on CPU,
fewer requests, no profile), for scale. Decode batching is the ``decode`` benchmark's.

``--code-dir DIR`` (or ``EPD_BENCH_CODE_DIR``) runs the stack's processes (API and workers)
from another checkout (``PYTHONPATH=DIR``, ``PYTHONSAFEPATH=1`` so the working directory does
not shadow it), so a "before" and an "after" are measured by the same benchmark;
``--requests N`` sizes the instant cells (the tiny model's get a quarter).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import os
import secrets
import subprocess
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from pydantic import SecretStr

from bench.common import Stats, budget, headroom, quantile, sig
from bench.worker_profile import WAITING_THROUGHOUT

T = TypeVar("T")

PROMPT = "Describe <image> briefly."
MAX_TOKENS = 4
IMAGE_SIDE = 224
CONCURRENCY = (1, 16)
CASES = ("new", "cached")
REQUEST_TIMEOUT_S = 120.0
CODE_DIR_ENV = "EPD_BENCH_CODE_DIR"
TOP_COMMANDS = 8
TOP_FRAMES = 8

MAX_CPU_MS_NEW_C16 = 12.0
MAX_CPU_MS_CACHED_C16 = 6.0
MIN_RPS_NEW_C16 = 80.0
MIN_RPS_CACHED_C16 = 150.0
MAX_IDLE_CPU_PCT = 2.0
MAX_OVERHEAD_VS_FLOOR_MS = 3.0
MAX_RSS_MB = 150.0
RSS_JUDGED = ("results", "router")
"""The processes whose RSS the budget bounds (the ones with no model to hold)."""

FLOOR_DEFINITION = {
    "new": "one broker hop (API -> encode topic -> encode worker) + two Redis notifications "
    "(the store put waking the prefill worker, whose own prefill-topic hop runs in parallel; "
    "the status record waking the API's long-poll)",
    "cached": "one broker hop (API -> prefill topic -> prefill worker) + one Redis "
    "notification (the status record waking the API's long-poll)",
    "not_counted": "no results-topic hop (stages write their outcome through to the status "
    "record; the collector is off the client's path); the HTTP round trips are the API's "
    "overhead (api_healthz_rtt_ms shows the bare server's)",
}


@dataclasses.dataclass(frozen=True, slots=True)
class Sizes:
    """How much one run does."""

    requests: int
    """Requests per instant cell."""
    tiny_requests: int
    """Requests per tiny-model cell (0: no tiny-model cells)."""
    warmup: int
    """Untimed requests of each case at the top concurrency before the first cell."""
    idle_s: float
    hops: int
    pings: int
    broker_warmup: int

    def with_requests(self, n: int | None) -> Sizes:
        if n is None:
            return self
        tiny = max(4, n // 4) if self.tiny_requests else 0
        return dataclasses.replace(self, requests=n, tiny_requests=tiny)


JIT_QUIET_MAX_S = 90.0
"""How long the idle window waits at most for a JVM broker's compilers to go quiet."""
SETTLE_SLACK_S = 3.0
"""Seconds past ``EPD_KAFKA_FETCH_IDLE_AFTER_S`` before the idle window starts (the loops'
last short polls end, a sweep pass backs off)."""
QUICK = Sizes(requests=8, tiny_requests=0, warmup=2, idle_s=3.0, hops=5, pings=50, broker_warmup=20)
FULL = Sizes(
    requests=320, tiny_requests=24, warmup=64, idle_s=20.0, hops=20, pings=300, broker_warmup=300
)
"""A cell runs for seconds, not one: a cell of ~1 s counted a good part of its neighbours'
tails (the collector's folds, the commits, the broker's JIT), and the warm-up runs every path
at load until the processes and the broker have compiled and cached what a request takes."""


# ---------------------------------------------------------------------------------------------
# Pure computations (unit-tested)


def latency_ms(samples_s: list[float]) -> dict[str, float]:
    """p50/p99 in ms of latencies in seconds."""
    return {
        "p50": sig(quantile(samples_s, 0.5) * 1000),
        "p99": sig(quantile(samples_s, 0.99) * 1000),
    }


def commandstats_delta(
    before: Mapping[str, Mapping[str, Any]], after: Mapping[str, Mapping[str, Any]], requests: int
) -> dict[str, Any]:
    """Redis commands per request between two ``INFO commandstats`` readings (redis-py's
    ``{"cmdstat_get": {"calls": N, "usec": U, ...}}`` or ``{"get": {...}}``): the total and the
    ``TOP_COMMANDS`` most called, each with its calls and the server's microseconds in it per
    request. The readings' own ``INFO`` is left out."""
    calls: dict[str, tuple[int, int]] = {}
    for key, now in after.items():
        name = key.removeprefix("cmdstat_")
        if name == "info":
            continue
        then = before.get(key, {})
        n = int(now.get("calls", 0)) - int(then.get("calls", 0))
        if n > 0:
            calls[name] = (n, int(now.get("usec", 0)) - int(then.get("usec", 0)))
    per = max(1, requests)
    top = sorted(calls.items(), key=lambda kv: (-kv[1][0], kv[0]))[:TOP_COMMANDS]
    return {
        "total": sig(sum(n for n, _ in calls.values()) / per),
        "server_usec_total": sig(sum(u for _, u in calls.values()) / per),
        "top": {name: {"calls": sig(n / per), "server_usec": sig(u / per)} for name, (n, u) in top},
    }


def offsets_delta(
    before: Mapping[str, int], after: Mapping[str, int], prefix: str, requests: int
) -> dict[str, Any]:
    """Kafka records per request between two end-offset readings (``{topic: sum of its
    partitions' end offsets}``): the total and each topic that grew, by its short name."""
    per = max(1, requests)
    grew = {t: after[t] - before.get(t, 0) for t in after if after[t] > before.get(t, 0)}
    return {
        "total": sig(sum(grew.values()) / per),
        "by_topic": {t.removeprefix(f"{prefix}."): sig(n / per) for t, n in sorted(grew.items())},
    }


def floor_ms(hop_p50_ms: float, notify_p50_ms: float) -> dict[str, float]:
    """The critical-path floor of each case (``FLOOR_DEFINITION``)."""
    return {
        "new": sig(hop_p50_ms + 2 * notify_p50_ms),
        "cached": sig(hop_p50_ms + notify_p50_ms),
    }


def overhead_vs_floor(cells: Mapping[str, Any], floor: Mapping[str, float]) -> dict[str, float]:
    """Latency p50 at concurrency 1 minus the floor, per case."""
    return {case: sig(cells[case]["c1"]["latency_ms"]["p50"] - floor[case]) for case in CASES}


def short_profile(summary: Mapping[str, Any], top: int = TOP_FRAMES) -> dict[str, Any]:
    """``WorkerProfiler.stop``'s summary, ``top`` frames a process (a process that was never
    sampled on CPU says so instead of reporting zero samples)."""
    out: dict[str, Any] = {}
    for name, s in summary.items():
        if not isinstance(s, dict):
            out[name] = s
        elif "samples" not in s:
            out[name] = {k: v for k, v in s.items() if k != "raw"}
        elif s["samples"] == 0:
            out[name] = WAITING_THROUGHOUT
        else:
            out[name] = {
                "samples": s["samples"],
                **{k: s[k] for k in ("waiting_pct", "event_loop_c_pct") if k in s},
                "self_pct": s["self_pct"][:top],
                "inclusive_pct": s["inclusive_pct"][:top],
            }
    return out


def judge(blocks: Mapping[str, Any]) -> tuple[str, dict[str, float], dict[str, float], bool]:
    """(judged broker, the judged figures, their headroom, met): CPU, requests/s, idle CPU and
    RSS on Apache Kafka (else the first broker); overhead vs floor, worst of both brokers and
    both cases."""
    judged_on = "apache" if "apache" in blocks else next(iter(blocks))
    b = blocks[judged_on]
    c16 = {case: b["cells"][case]["c16"] for case in CASES}
    figures = {
        "cpu_ms_per_request_new_c16": c16["new"]["cpu_ms_per_request"]["total"],
        "cpu_ms_per_request_cached_c16": c16["cached"]["cpu_ms_per_request"]["total"],
        "requests_per_s_new_c16": c16["new"]["requests_per_s"],
        "requests_per_s_cached_c16": c16["cached"]["requests_per_s"],
        "idle_cpu_pct": b["idle_cpu_pct"]["total"],
        "rss_mb_results_router": max(b["rss_mb"][p] for p in RSS_JUDGED),
        "overhead_vs_floor_p50_ms": max(
            v for blk in blocks.values() for v in blk["overhead_vs_floor_ms"].values()
        ),
    }
    lower = {
        "cpu_ms_per_request_new_c16": MAX_CPU_MS_NEW_C16,
        "cpu_ms_per_request_cached_c16": MAX_CPU_MS_CACHED_C16,
        "idle_cpu_pct": MAX_IDLE_CPU_PCT,
        "rss_mb_results_router": MAX_RSS_MB,
        "overhead_vs_floor_p50_ms": MAX_OVERHEAD_VS_FLOOR_MS,
    }
    higher = {
        "requests_per_s_new_c16": MIN_RPS_NEW_C16,
        "requests_per_s_cached_c16": MIN_RPS_CACHED_C16,
    }
    room = {k: headroom(figures[k], v, higher_is_better=False) for k, v in lower.items()}
    room |= {k: headroom(figures[k], v, higher_is_better=True) for k, v in higher.items()}
    met = all(figures[k] <= v for k, v in lower.items()) and all(
        figures[k] >= v for k, v in higher.items()
    )
    return judged_on, figures, room, met


# ---------------------------------------------------------------------------------------------
# The stack: topics, workers and the API as processes


def code_env(code_dir: Path | None) -> dict[str, str]:
    """What makes a child process import the stack's code from ``code_dir`` (nothing: this
    checkout's, as the benchmark itself)."""
    if code_dir is None:
        return {}
    return {"PYTHONPATH": str(code_dir.resolve()), "PYTHONSAFEPATH": "1"}


def code_facts(code_dir: Path | None) -> dict[str, Any]:
    """Which code the stack ran: the directory and its commit (``-dirty`` with changes)."""
    where = (code_dir or Path(__file__).resolve().parents[1]).resolve()

    def git(*args: str) -> str:
        done = subprocess.run(
            ["git", "-C", str(where), *args], capture_output=True, text=True, timeout=10
        )
        return done.stdout.strip()

    try:
        commit = git("rev-parse", "HEAD")
        dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.SubprocessError):
        commit, dirty = "", False
    return {"dir": str(where), "commit": (commit or "unknown") + ("-dirty" if dirty else "")}


@dataclasses.dataclass
class Stack:
    """One running stack: its settings, processes and the clients that measure it."""

    settings: Any
    workers: Any
    api: Any
    pids: dict[str, int]
    """api, each worker, broker, redis (where visible)."""
    offsets: Any
    partitions: list[Any]
    """Every partition of the run's topics (``TopicPartition``)."""
    redis: Any

    def check_alive(self) -> None:
        self.workers.check_alive()
        if self.api.proc.poll() is not None:
            raise RuntimeError(f"epd api exited with {self.api.proc.returncode}")

    async def end_offsets(self) -> dict[str, int]:
        """Each of the run's topics' end offsets, summed over its partitions."""
        ends = await self.offsets.end_offsets(self.partitions)
        out = dict.fromkeys(sorted({tp.topic for tp in self.partitions}), 0)
        for tp, end in ends.items():
            out[tp.topic] += int(end)
        return out

    async def commandstats(self) -> dict[str, Any]:
        return dict(await self.redis.info("commandstats"))


@contextlib.asynccontextmanager
async def running_stack(
    base: Any, model: str, log_dir: Path, code_dir: Path | None
) -> AsyncIterator[Stack]:
    """The topics, ``epd stack``'s workers and ``epd api`` as processes, with ``EPD_MODEL``
    ``model``, under a topic prefix, EC namespace and secret of their own."""
    import redis.asyncio as aioredis
    from aiokafka import TopicPartition

    from bench.api_process import ApiProcess
    from bench.pipeline import _delete_topics, _service_pids
    from epd.commands.stack import STACK_WORKERS
    from epd.local_pipeline import WorkerProcesses, child_env, worker_env
    from runtime.kafka import ensure_topics, make_consumer, topic_partitions
    from schemas.topics import Topics

    tag = f"{base.topic_prefix}-{model}"
    settings = base.model_copy(
        update={
            "model": model,
            "topic_prefix": tag,
            "ec_namespace": f"ec-{tag}",
            "ec_secret": SecretStr(secrets.token_hex(16)),
        }
    )
    topics = Topics(settings.topic_prefix).all()
    await ensure_topics(settings, topics)
    env = {**worker_env(settings), **code_env(code_dir)}
    workers = WorkerProcesses(env, log_dir, STACK_WORKERS)
    workers.start()  # makes log_dir
    api = ApiProcess(child_env(env), log_dir / "api.log")
    offsets = make_consumer(settings, group_id=None)
    client = aioredis.Redis.from_url(settings.redis_url)
    try:
        await asyncio.gather(workers.wait_ready(), api.ready())
        await offsets.start()
        parts = await topic_partitions(settings, topics)
        if set(parts) != set(topics):
            raise RuntimeError(f"topics without partitions: {set(topics) - set(parts)}")
        tps = [TopicPartition(t, p) for t, ps in parts.items() for p in ps]
        pids = {"api": api.proc.pid, **{k: p.pid for k, p, _ in workers.procs}}
        pids |= _service_pids(settings)
        yield Stack(settings, workers, api, pids, offsets, tps, client)
    finally:
        await offsets.stop()
        await client.aclose()
        api.stop()
        await asyncio.to_thread(workers.stop)
        await _delete_topics(settings, topics)


async def guarded(stack: Stack, work: Awaitable[T]) -> T:
    """``work``, ended with the log's tail as soon as a stack process dies (not at a timeout)."""
    task = asyncio.ensure_future(work)
    while True:
        done, _ = await asyncio.wait({task}, timeout=1.0)
        if done:
            return task.result()
        try:
            stack.check_alive()
        except BaseException:
            task.cancel()
            raise


# ---------------------------------------------------------------------------------------------
# Load through the HTTP API


async def drive(client: Any, images: list[bytes], concurrency: int) -> tuple[list[float], float]:
    """Every image as one request, ``concurrency`` lanes at a time, each submitted and waited
    on as a client does; (latencies in s, wall in s)."""
    pending = iter(images)
    latencies: list[float] = []

    async def lane() -> None:
        for png in pending:  # shared: each lane takes the next image
            t0 = time.perf_counter()
            st = await client.run(
                prompt=PROMPT, images=[png], max_tokens=MAX_TOKENS, timeout_s=REQUEST_TIMEOUT_S
            )
            if st.status != "completed":
                raise RuntimeError(f"request {st.request_id} ended {st.status}: {st.error}")
            latencies.append(time.perf_counter() - t0)

    t0 = time.perf_counter()
    await asyncio.gather(*(lane() for _ in range(concurrency)))
    return latencies, time.perf_counter() - t0


class Images:
    """224x224 PNGs: a new one each time, or the one repeated image of a stack."""

    def __init__(self, start: int) -> None:
        self.seeds = itertools.count(start)
        self.cached = self.new(1)[0]

    def new(self, n: int) -> list[bytes]:
        from media.sample_images import png_bytes, synthetic_image

        side = IMAGE_SIDE
        return [png_bytes(synthetic_image(side, side, next(self.seeds))) for _ in range(n)]

    def of(self, case: str, n: int) -> list[bytes]:
        return self.new(n) if case == "new" else [self.cached] * n


async def measure_cell(stack: Stack, client: Any, images: list[bytes], concurrency: int) -> dict:
    """One cell: the requests, and what the stack spent on them."""
    from bench.worker_profile import CpuMeter, context_switches, switches_per_request

    n = len(images)
    meter = CpuMeter(stack.pids)
    offsets0, stats0 = await stack.end_offsets(), await stack.commandstats()
    switches0 = {name: context_switches(pid) for name, pid in stack.pids.items()}
    meter.restart()
    cpu0 = time.process_time()
    latencies, wall = await guarded(stack, drive(client, images, concurrency))
    client_cpu = time.process_time() - cpu0
    cpu = meter.per_request(n)
    switches1 = {name: context_switches(pid) for name, pid in stack.pids.items()}
    offsets1, stats1 = await stack.end_offsets(), await stack.commandstats()
    return {
        "requests": n,
        "concurrency": concurrency,
        "wall_s": sig(wall),
        "requests_per_s": sig(n / wall),
        "latency_ms": latency_ms(latencies),
        "cpu_ms_per_request": cpu,
        "client_cpu_ms_per_request": sig(1000 * client_cpu / n),
        "context_switches_per_request": switches_per_request(switches0, switches1, n),
        "kafka_records_per_request": offsets_delta(
            offsets0, offsets1, stack.settings.topic_prefix, n
        ),
        "redis_commands_per_request": commandstats_delta(stats0, stats1, n),
    }


async def warm_up(stack: Stack, client: Any, images: Images, n: int) -> None:
    """Untimed: a few new and cached images one at a time (the cached image's embedding lands
    in the store here), then ``n`` of each at the top concurrency."""
    top = max(CONCURRENCY)
    few = min(n, 4)
    await guarded(stack, drive(client, images.of("new", few), 1))
    await guarded(stack, drive(client, images.of("cached", few), 1))
    for case in CASES:
        await guarded(stack, drive(client, images.of(case, n), top))


async def run_cells(
    stack: Stack, images: Images, n: int, warmup: int, profile_dir: Path | None
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The four cells (new/cached x concurrency 1/16); with ``profile_dir``, each top-concurrency
    cell again under py-spy. (cells, profiles)"""
    from bench.worker_profile import WorkerProfiler
    from frontend.client import EPDClient

    cells: dict[str, Any] = {case: {} for case in CASES}
    profiles: dict[str, Any] = {}
    async with EPDClient(stack.api.url, timeout_s=60, retries=0) as client:
        await warm_up(stack, client, images, warmup)
        for concurrency in CONCURRENCY:
            for case in CASES:
                cells[case][f"c{concurrency}"] = await measure_cell(
                    stack, client, images.of(case, n), concurrency
                )
        if profile_dir is not None:
            top = max(CONCURRENCY)
            sampled = {k: v for k, v in stack.pids.items() if k not in ("broker", "redis")}
            for case in CASES:
                batch = images.of(case, n)
                profiler = WorkerProfiler(sampled, profile_dir / case, skip_waits=True)
                profiler.start()
                try:
                    await guarded(stack, drive(client, batch, top))
                finally:
                    summary = await asyncio.to_thread(profiler.stop)
                profiles[f"{case}_c{top}"] = short_profile(summary)
    for name, cell in cells["cached"].items():
        if "encode" in cell["kafka_records_per_request"]["by_topic"]:
            cell["warning"] = f"cached {name}: encode events were sent (cache misses)"
    return cells, profiles


# ---------------------------------------------------------------------------------------------
# Which process sends which Redis commands


def tally_monitor(lines: Sequence[Mapping[str, Any]], owners: Mapping[str, str]) -> dict[str, Any]:
    """Redis ``MONITOR`` lines (redis-py's ``{"client_type", "client_port", "command"}``) as
    commands per process: ``owners`` names a client port's process; a script's own commands
    (client ``lua``) count for the client whose ``EVALSHA`` ran it, as ``lua:CMD``."""
    by: dict[str, dict[str, int]] = {}
    last = "unknown"
    for line in lines:
        name = (line["command"].split(" ", 1)[0] or "?").strip('"').upper()
        if line["client_type"] == "lua":
            who, name = last, f"lua:{name}"
        else:
            who = last = owners.get(str(line["client_port"]), "other")
        counts = by.setdefault(who, {})
        counts[name] = counts.get(name, 0) + 1
    return {
        who: {
            "total": sum(c.values()),
            "commands": dict(sorted(c.items(), key=lambda kv: (-kv[1], kv[0]))),
        }
        for who, c in sorted(by.items())
    }


def port_owners(pids: Mapping[str, int]) -> dict[str, str]:
    """Each local TCP port a stack process holds, named by the process."""
    import psutil

    names = {pid: name for name, pid in pids.items()}
    out = {}
    for conn in psutil.net_connections(kind="tcp"):
        if conn.pid in names and conn.laddr:
            out[str(conn.laddr.port)] = names[conn.pid]
    return out


async def monitored(stack: Stack, client: Any, images: list[bytes], settle_s: float) -> list[Any]:
    """The ``MONITOR`` lines of Redis while ``images`` are sent one at a time, and ``settle_s``
    after."""
    import redis.asyncio as aioredis

    lines: list[Any] = []
    watcher = aioredis.Redis.from_url(stack.settings.redis_url)
    try:
        async with watcher.monitor() as monitor:

            async def collect() -> None:
                async for line in monitor.listen():
                    lines.append(line)

            task = asyncio.create_task(collect())
            await asyncio.sleep(0.1)  # MONITOR is on
            try:
                await guarded(stack, drive(client, images, 1))
                await asyncio.sleep(settle_s)
            finally:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
    finally:
        await watcher.aclose()
    return lines


async def redis_trace(stack: Stack, images: Images, settle_s: float = 0.5) -> dict[str, Any]:
    """One request of each case, alone, with ``MONITOR`` on: its Redis commands by process
    (over the request and ``settle_s`` after it, so the collector's folds are in)."""
    from frontend.client import EPDClient

    out: dict[str, Any] = {"window": f"one request, from its submit to {settle_s:g} s after it"}
    async with EPDClient(stack.api.url, timeout_s=60, retries=0) as client:
        for case in CASES:
            lines = await monitored(stack, client, images.of(case, 1), settle_s)
            owners = await asyncio.to_thread(port_owners, stack.pids)
            out[case] = tally_monitor(lines, owners)
    return out


# ---------------------------------------------------------------------------------------------
# The floor, idle CPU, RSS


async def redis_floor(redis_url: str, n: int) -> dict[str, Any]:
    """A bare Redis round trip (PING) and notification (PUBLISH -> the subscriber reads it)."""
    import redis.asyncio as aioredis

    client = aioredis.Redis.from_url(redis_url)
    listener = aioredis.Redis.from_url(redis_url)
    channel = f"bench-floor-{secrets.token_hex(4)}"
    rtt: list[float] = []
    notify: list[float] = []
    try:
        for _ in range(n + 5):
            t0 = time.perf_counter()
            await client.ping()
            rtt.append(time.perf_counter() - t0)
        async with listener.pubsub() as ps:
            await ps.subscribe(channel)
            while await ps.get_message(timeout=1.0) is None:
                pass  # the subscription's confirmation
            for _ in range(n + 5):
                t0 = time.perf_counter()
                await client.publish(channel, b"x")
                while await ps.get_message(ignore_subscribe_messages=True, timeout=1.0) is None:
                    pass
                notify.append(time.perf_counter() - t0)
    finally:
        await client.aclose()
        await listener.aclose()
    return {
        "round_trip": Stats(rtt[5:]).to_json("ms"),
        "notify": Stats(notify[5:]).to_json("ms"),
    }


async def http_floor(url: str, n: int) -> dict[str, float | int]:
    """``GET /healthz`` on the API: the HTTP server's own round trip (not in the floor)."""
    import httpx

    samples = []
    async with httpx.AsyncClient(base_url=url) as http:
        for i in range(n + 5):
            t0 = time.perf_counter()
            (await http.get("/healthz")).raise_for_status()
            if i >= 5:
                samples.append(time.perf_counter() - t0)
    return Stats(samples).to_json("ms")


async def floor(stack: Stack, sizes: Sizes) -> dict[str, Any]:
    """The bare hops, measured with the stack up and idle; the floor of each case; and what
    the bare operations cost in CPU here (:mod:`bench.bare_costs`)."""
    from bench.bare_costs import bare_costs
    from bench.pipeline import _delete_topics, _kafka_hop

    topic = f"{stack.settings.topic_prefix}.bench-hop"
    try:
        hop = await _kafka_hop(stack.settings, topic, sizes.hops)
    finally:
        await _delete_topics(stack.settings, [topic])
    redis = await redis_floor(stack.settings.redis_url, sizes.pings)
    hop_p50 = hop["total"]["p50_ms"]
    notify_p50 = redis["notify"]["p50_ms"]
    return {
        "floor_ms": floor_ms(hop_p50, notify_p50),
        "definition": FLOOR_DEFINITION,
        "kafka_hop_p50_ms": hop_p50,
        "redis_notify_p50_ms": notify_p50,
        "redis_round_trip_p50_ms": redis["round_trip"]["p50_ms"],
        "kafka_hop": hop,
        "api_healthz_rtt_ms": await http_floor(stack.api.url, min(sizes.pings, 100)),
        "bare_cpu": await bare_costs(
            stack.settings, stack.pids, records=sizes.hops * 15, pings=sizes.pings
        ),
    }


async def idle(stack: Stack, seconds: float) -> dict[str, Any]:
    """% of one core each stack process used with no traffic, all together (``total``, the
    judged one) and the API's and workers' alone (``api_and_workers``: without the broker and
    Redis), once the stack has settled. The seconds after traffic are its tail, reported apart
    as ``just_after_traffic``: the consume loops switch to the idle fetch only after
    ``EPD_KAFKA_FETCH_IDLE_AFTER_S`` without records, and a JVM broker goes on compiling what
    the load made hot (its JIT threads) for up to a minute; the window starts when both are
    over (``settled_after_s``)."""
    from bench.worker_profile import busiest_threads, idle_cpu, thread_cpu

    started = time.perf_counter()
    await asyncio.sleep(1.0)  # the last cell's own tail: commits, the collector's folds
    settle_s = float(stack.settings.kafka_fetch_idle_after_s) + SETTLE_SLACK_S
    tail = await asyncio.to_thread(idle_cpu, stack.pids, settle_s)
    broker = stack.pids.get("broker")
    if broker:
        await _jit_quiet(broker, JIT_QUIET_MAX_S)
    settled = time.perf_counter() - started
    threads = thread_cpu(broker) if broker else {}
    pct = await asyncio.to_thread(idle_cpu, stack.pids, seconds)
    return {
        **_idle_figures(pct),
        "settled_after_s": sig(settled),
        # Where the broker's share goes, by thread (a JVM names its compilers, GC and timers).
        "broker_threads": busiest_threads(broker, threads, seconds) if broker else {},
        "just_after_traffic": {"over_s": sig(settle_s), **_idle_figures(tail)},
    }


async def _jit_quiet(pid: int, max_s: float) -> None:
    """Return once ``pid``'s JIT compiler threads (a JVM's ``C1/C2 CompilerThread``; none in
    another broker) used no CPU for two seconds running, or after ``max_s``."""
    from bench.worker_profile import thread_cpu

    def compiling() -> int:
        return sum(t for name, t in thread_cpu(pid).items() if "CompilerThre" in name)

    deadline = time.perf_counter() + max_s
    last, quiet = compiling(), 0
    while quiet < 2 and time.perf_counter() < deadline:
        await asyncio.sleep(1.0)
        now = compiling()
        quiet = quiet + 1 if now == last else 0
        last = now


def _idle_figures(pct: dict[str, float]) -> dict[str, float]:
    ours = sum(v for k, v in pct.items() if k not in ("broker", "redis"))
    return {**pct, "total": sig(sum(pct.values())), "api_and_workers": sig(ours)}


def rss(stack: Stack) -> dict[str, float]:
    from bench.worker_profile import rss_mb

    return {name: sig(v) for name, pid in stack.pids.items() if (v := rss_mb(pid)) is not None}


def pss(stack: Stack) -> dict[str, float]:
    """Each process's share of the memory it maps (the libraries all workers load, torch's
    first, count once across them): what the stack's processes hold together."""
    from bench.worker_profile import pss_mb

    out = {name: sig(v) for name, pid in stack.pids.items() if (v := pss_mb(pid)) is not None}
    return {**out, "total": sig(sum(out.values()))} if out else out


# ---------------------------------------------------------------------------------------------
# One broker


async def broker_block(
    settings: Any, log_dir: Path, sizes: Sizes, code_dir: Path | None
) -> dict[str, Any]:
    """The instant stack's cells, profiles, RSS, idle CPU and floor on one broker; then the
    tiny model's cells."""
    from bench.pipeline import _warm_broker

    await _warm_broker(settings, sizes.broker_warmup)
    images = Images(start=1000)
    t0 = time.perf_counter()
    block: dict[str, Any] = {"load_avg_1m": {"start": sig(os.getloadavg()[0])}}
    async with running_stack(settings, "instant", log_dir / "instant", code_dir) as stack:
        block["startup_s"] = sig(time.perf_counter() - t0)
        block["fetch_max_wait_ms"] = stack.settings.kafka_fetch_max_wait_ms
        block["event_loop"] = getattr(stack.settings, "event_loop", "asyncio")
        block["cells"], profiles = await run_cells(
            stack, images, sizes.requests, sizes.warmup, log_dir / "profiles"
        )
        block["redis_by_process"] = await redis_trace(stack, images)
        block["rss_mb"] = rss(stack)
        block["pss_mb"] = pss(stack)
        block["idle_cpu_pct"] = {
            "what": f"% of one core over {sizes.idle_s:g} s with no traffic, once settled",
            **await idle(stack, sizes.idle_s),
        }
        block["floor"] = await floor(stack, sizes)
    block["load_avg_1m"]["instant_done"] = sig(os.getloadavg()[0])  # a busy host: noisy figures
    block["overhead_vs_floor_ms"] = overhead_vs_floor(block["cells"], block["floor"]["floor_ms"])
    block["profile"] = profiles
    if sizes.tiny_requests:
        async with running_stack(settings, "tiny", log_dir / "tiny", code_dir) as stack:
            cells, _ = await run_cells(stack, images, sizes.tiny_requests, 2, None)
            block["tiny_model"] = {"cells": cells, "rss_mb": rss(stack)}
    return block


def _side_by_side(blocks: Mapping[str, Any]) -> dict[str, Any]:
    """The headline figures of each broker, next to each other."""

    def per_case(b: Mapping[str, Any], cell: str, *keys: str) -> dict[str, Any]:
        out = {}
        for case in CASES:
            v = b["cells"][case][cell]
            for k in keys:
                v = v[k]
            out[case] = v
        return out

    out = {}
    for kind, b in blocks.items():
        out[kind] = {
            "cpu_ms_per_request_c16": per_case(b, "c16", "cpu_ms_per_request", "total"),
            "requests_per_s_c16": per_case(b, "c16", "requests_per_s"),
            "latency_p50_ms_c1": per_case(b, "c1", "latency_ms", "p50"),
            "floor_ms": b["floor"]["floor_ms"],
            "overhead_vs_floor_ms": b["overhead_vs_floor_ms"],
            "idle_cpu_pct": b["idle_cpu_pct"]["total"],
        }
    return out


def run(
    *,
    quick: bool = False,
    out: Path | None = None,
    redis_url: str | None = None,
    code_dir: Path | None = None,
    requests: int | None = None,
) -> dict[str, Any]:
    """Each broker's block, one broker after the other; the report block."""
    from bench.pipeline import bench_brokers, embedded_broker, pipeline_settings, private_redis

    sizes = (QUICK if quick else FULL).with_requests(requests)
    if code_dir is None and os.environ.get(CODE_DIR_ENV):
        code_dir = Path(os.environ[CODE_DIR_ENV])
    if code_dir is not None and not (code_dir / "epd" / "cli.py").exists():
        raise FileNotFoundError(f"--code-dir {code_dir}: no epd/cli.py there")
    base = (out / "coordinator-logs") if out else Path(tempfile.mkdtemp(prefix="bench-coord-"))
    names, skipped = bench_brokers()
    blocks: dict[str, Any] = {}
    for kind in names:
        log_dir = base / kind
        log_dir.mkdir(parents=True, exist_ok=True)
        with contextlib.ExitStack() as services:
            broker_env = None
            if kind != "env":
                broker_env = services.enter_context(embedded_broker(kind, log_dir))
                own = services.enter_context(private_redis(log_dir))
                broker_env = {**broker_env, **({"EPD_REDIS_URL": own} if own else {})}
            settings, prefix = pipeline_settings(
                (broker_env or {}).get("EPD_REDIS_URL") or redis_url, broker_env
            )
            try:
                blocks[kind] = asyncio.run(broker_block(settings, log_dir, sizes, code_dir))
            finally:
                asyncio.run(_cleanup(settings.redis_url, prefix))
    if not blocks:
        raise RuntimeError(f"no broker to benchmark on: {skipped or 'none asked for'}")
    return report(blocks, skipped, sizes, code_dir, base)


async def _cleanup(redis_url: str, prefix: str) -> None:
    from bench.pipeline import _cleanup_redis

    await _cleanup_redis(redis_url, prefix)


def report(
    blocks: dict[str, Any],
    skipped: dict[str, str],
    sizes: Sizes,
    code_dir: Path | None,
    logs: Path,
) -> dict[str, Any]:
    judged_on, figures, room, met = judge(blocks)
    return {
        "request": f"one {IMAGE_SIDE}x{IMAGE_SIDE} PNG (1.2 MB of fp32 pixels once rendered, "
        f"claim-checked), {MAX_TOKENS} new tokens, through the HTTP API (multipart submit, "
        "long-polled to its end); EPD_MODEL=instant: every stage, no model compute",
        "stack": "epd api + results, encode, prefill, router workers (epd stack's), processes",
        "code": code_facts(code_dir),
        "requests_per_cell": sizes.requests,
        "concurrency": list(CONCURRENCY),
        "cases": {"new": "a new image every request", "cached": "one image repeated (hit)"},
        "judged_on": judged_on,
        "brokers": blocks,
        "skipped_brokers": skipped,
        "side_by_side": _side_by_side(blocks),
        "decode_batching": "not measured here: the `decode` benchmark (epd bench decode)",
        "logs": str(logs),
        "judged": figures,
        "headroom": room,
        "budget": budget(
            "Coordinator cost on the instant engine, 224x224 image, judged on Apache Kafka: "
            f"stack CPU per request at concurrency 16 <= {MAX_CPU_MS_NEW_C16:g} ms (new image) "
            f"and <= {MAX_CPU_MS_CACHED_C16:g} ms (cached); requests/s at concurrency 16 >= "
            f"{MIN_RPS_NEW_C16:g} (new) and >= {MIN_RPS_CACHED_C16:g} (cached); idle stack CPU "
            f"<= {MAX_IDLE_CPU_PCT:g} % of a core; RSS of the results and router workers <= "
            f"{MAX_RSS_MB:g} MB; latency p50 at concurrency 1 within "
            f"{MAX_OVERHEAD_VS_FLOOR_MS:g} ms of the critical-path floor (bare broker hop and "
            "Redis notifications, measured beside it) on both brokers, both cases",
            max_cpu_ms_per_request_new_c16=MAX_CPU_MS_NEW_C16,
            max_cpu_ms_per_request_cached_c16=MAX_CPU_MS_CACHED_C16,
            min_requests_per_s_new_c16=MIN_RPS_NEW_C16,
            min_requests_per_s_cached_c16=MIN_RPS_CACHED_C16,
            max_idle_cpu_pct=MAX_IDLE_CPU_PCT,
            max_rss_mb_results_router=MAX_RSS_MB,
            max_overhead_vs_floor_p50_ms=MAX_OVERHEAD_VS_FLOOR_MS,
        ),
        "meets_budget": met,
    }
