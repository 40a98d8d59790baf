"""The testcontainers suite: Tansu and Redis in containers, framed events and values through them.

Images are built ``FROM scratch`` out of binaries on this machine (``docker/build-images.sh``),
because no registry can be reached. Containers use host networking and bind 127.0.0.1 only.
Without a Docker daemon the docker tests skip, except under ``CI``, where they fail: CI must run
this suite (``.ci/run`` starts dockerd).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
import yaml

from epd import services
from epd.cli import build_parser
from runtime.kafka import ensure_topics, make_consumer, make_producer, send_event
from runtime.settings import Settings
from schemas.codec import SCHEMA_HEADER, get_codec
from schemas.types import ECTransfer, EncodeEvent, ResultEvent

# testcontainers reads this when its config is first used: no reaper container (it would need a
# pull), our fixtures remove their containers themselves.
os.environ.setdefault("TESTCONTAINERS_RYUK_DISABLED", "true")

ROOT = Path(__file__).resolve().parents[2]
BUILD_IMAGES = ROOT / "docker" / "build-images.sh"
COMPOSE_FILE = ROOT / "docker-compose.yml"
READY_TIMEOUT_S = 60.0


@pytest.fixture(scope="module")
def docker_client() -> Iterator[object]:
    """A docker-py client that answers; skip without a daemon, fail without one in CI."""
    import docker

    try:
        client = docker.from_env()
        client.ping()
    except Exception as exc:
        reason = f"no Docker daemon answers ({type(exc).__name__}: {exc})"
        if os.environ.get("CI"):
            pytest.fail(f"CI must run the testcontainers suite but {reason}", pytrace=False)
        pytest.skip(f"{reason}; start one with `sudo docker/ensure-dockerd.sh` to run this suite")
    yield client
    client.close()


@pytest.fixture(scope="module")
def images(docker_client: object) -> dict[str, str]:
    """Names of the scratch images (built on first use): ``{"tansu": ..., "redis": ...}``."""
    env = {**os.environ, "PYTHON": sys.executable}
    proc = subprocess.run(
        ["bash", str(BUILD_IMAGES)], capture_output=True, text=True, env=env, check=False
    )
    if proc.returncode != 0:
        pytest.fail(f"docker/build-images.sh failed:\n{proc.stderr}", pytrace=False)
    return dict(line.split("=", 1) for line in proc.stdout.split() if "=" in line)


@contextlib.contextmanager
def _running(image: str, command: list[str], ready: Callable[[], bool]) -> Iterator[object]:
    """A host-network container of ``image`` that answers ``ready``; removed afterwards."""
    from testcontainers.core.container import DockerContainer

    container = DockerContainer(image).with_command(command).with_kwargs(network_mode="host")
    container.start()
    try:

        def alive() -> bool:
            wrapped = container.get_wrapped_container()
            wrapped.reload()
            return wrapped.status in ("created", "running")

        if not services.wait_until(ready, READY_TIMEOUT_S, alive=alive):
            out, err = container.get_logs()
            pytest.fail(f"{image} did not answer:\n{out.decode()}{err.decode()}", pytrace=False)
        yield container
    finally:
        container.stop()


@pytest.fixture(scope="module")
def kafka_container(images: dict[str, str]) -> Iterator[str]:
    """Bootstrap address of a Tansu broker running in a container."""
    port = services.free_port()
    url = f"tcp://127.0.0.1:{port}"
    command = ["--listener-url", url, "--advertised-listener-url", url]
    command += ["--storage-engine", "memory://tansu/"]
    bootstrap = f"127.0.0.1:{port}"
    with _running(images["tansu"], command, lambda: services.kafka_answers(bootstrap, 2.0)):
        yield bootstrap


@pytest.fixture(scope="module")
def redis_container(images: dict[str, str]) -> Iterator[str]:
    """URL (DB 0 of a private server) of a Redis running in a container."""
    port = services.free_port()
    command = ["--bind", "127.0.0.1", "--port", str(port), "--save", "", "--appendonly", "no"]
    url = f"redis://127.0.0.1:{port}/0"
    with _running(images["redis"], command, lambda: services.redis_answers(url)):
        yield url


@pytest.mark.docker
async def test_events_and_values_through_containers(
    kafka_container: str, redis_container: str
) -> None:
    import redis.asyncio as aioredis

    settings = Settings(
        kafka_bootstrap=kafka_container, redis_url=redis_container, kafka_idempotence=False
    )
    topic = "containers.encode"
    await ensure_topics(settings, [topic], partitions=2)

    pixels = torch.randn(64, 1176, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    ec = ECTransfer("h" * 64, redis_container, "ec:tiny:" + "h" * 64, 1 << 41, "ab" * 32)
    events = [
        EncodeEvent("r1", "tiny", "image", 0, "h" * 64, {"pixel_values": pixels}, ec),
        ResultEvent("r1", "encode", "completed", timings={"encode": 2.0}),
    ]
    producer = make_producer(settings)
    await producer.start()
    try:
        for ev in events:
            await send_event(producer, topic, "r1", ev)
    finally:
        await producer.stop()

    consumer = make_consumer(settings, topic, group_id=None)
    await consumer.start()
    try:
        records = [await consumer.getone() for _ in events]  # one key: one partition, in order
    finally:
        await consumer.stop()
    codec = get_codec()
    assert [dict(r.headers)[SCHEMA_HEADER].decode() for r in records] == [
        "epd.EncodeEvent",
        "epd.ResultEvent",
    ]
    encode = codec.decode(records[0].value, EncodeEvent)
    got = encode.data["pixel_values"]
    assert isinstance(got, torch.Tensor) and got.dtype == torch.bfloat16
    assert torch.equal(got, pixels)
    assert codec.decode(records[1].value, ResultEvent).timings == {"encode": 2.0}

    # The embedding store's wire pattern: raw tensor bytes under a key, read back bit-exact.
    client = aioredis.Redis.from_url(redis_container)
    try:
        raw = pixels.view(torch.int16).numpy().tobytes()
        await client.set(ec.key, raw, ex=60)
        back = await client.get(ec.key)
    finally:
        await client.aclose()
    assert back == raw
    restored = torch.frombuffer(bytearray(back), dtype=torch.bfloat16).view(64, 1176)
    assert torch.equal(restored, pixels)


def test_compose_file_is_a_valid_stack() -> None:
    """docker-compose.yml: Kafka in KRaft mode, Redis and the pipeline services, all on the
    host network, GPU workers with an nvidia reservation, configuration through EPD_*, and
    every service command a real ``epd`` sub-command."""
    spec = yaml.safe_load(COMPOSE_FILE.read_text())
    svcs = spec["services"]
    assert {"kafka", "redis", "router", "encode-worker", "prefill-worker", "results", "api"} <= set(
        svcs
    )
    assert svcs["kafka"]["image"].startswith("apache/kafka")
    assert "controller" in svcs["kafka"]["environment"]["KAFKA_PROCESS_ROLES"]
    for name, svc in svcs.items():
        assert svc.get("network_mode") == "host", f"{name} must use host networking"
        assert "ports" not in svc, f"{name} must not publish ports through a bridge"
    for name in ("encode-worker", "prefill-worker"):
        devices = svcs[name]["deploy"]["resources"]["reservations"]["devices"]
        assert any(d.get("driver") == "nvidia" and "gpu" in d["capabilities"] for d in devices)
    parser = build_parser()
    for name in ("topics", "router", "encode-worker", "prefill-worker", "results", "api"):
        env = svcs[name]["environment"]
        assert env["EPD_KAFKA_BOOTSTRAP"] and env["EPD_REDIS_URL"], name
        assert svcs[name]["build"]["dockerfile"] == "docker/Dockerfile"
        # the image's entrypoint is `epd`: the command must parse as one of its sub-commands
        args = parser.parse_args(svcs[name]["command"])
        assert callable(args.func), name
    # the API is healthy only when ready (broker, Redis, topics)
    assert "/readyz" in " ".join(svcs["api"]["healthcheck"]["test"])


@pytest.mark.skipif(shutil.which("docker-compose") is None, reason="docker-compose not installed")
def test_compose_file_parses_with_docker_compose() -> None:
    proc = subprocess.run(
        ["docker-compose", "-f", str(COMPOSE_FILE), "config", "-q"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
