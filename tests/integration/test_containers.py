"""The service layer itself (tests/services.py) and the compose file.

Every integration test gets its broker and Redis from ``tests/services.py``; under CI that is
testcontainers (``EPD_TEST_SERVICES=containers``: Tansu and redis-server images built ``FROM
scratch`` from binaries on this machine, since no registry can be reached; the official
``apache/kafka`` and ``redis:7`` images on a laptop with a registry). The tests here check the
layer's own promises: the mode rules, a forced mode that cannot start fails loudly, faults act
on the services, and framed events and tensor values cross them bit-exact.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import subprocess
import uuid
from pathlib import Path

import pytest
import torch
import yaml

from epd import services
from epd.cli import build_parser
from runtime.kafka import KafkaPublisher, ensure_topics, make_consumer, make_producer, read_topic
from runtime.settings import Settings
from schemas.codec import SCHEMA_HEADER, get_codec
from schemas.types import ECTransfer, EncodeEvent, ResultEvent
from tests import services as layer

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = ROOT / "docker-compose.yml"
VARIABLE = re.compile(r"\$\{(\w+):-([^}]*)\}")


def default(value: str) -> str:
    """``value`` with each ``${NAME:-default}`` as its default (what Compose runs unset)."""
    return VARIABLE.sub(lambda m: m.group(2), value)


def test_mode_rules() -> None:
    assert layer.choose_mode({"EPD_TEST_SERVICES": "embedded"}) == ("embedded", True)
    assert layer.choose_mode({"EPD_TEST_SERVICES": "Containers "}) == ("containers", True)
    assert layer.choose_mode({"EPD_KAFKA_BOOTSTRAP": "127.0.0.1:1"}) == ("env", False)
    assert layer.choose_mode({"EPD_REDIS_URL": "redis://127.0.0.1:1/0"}) == ("env", False)
    with pytest.raises(layer.ServicesUnavailable, match="choose one of"):
        layer.choose_mode({"EPD_TEST_SERVICES": "cloud"})


def test_a_forced_mode_that_cannot_start_fails_instead_of_falling_back(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("EPD_TEST_SERVICES", "containers")
    monkeypatch.setenv("DOCKER_HOST", f"unix://{tmp_path}/no-docker.sock")
    with pytest.raises(layer.ServicesUnavailable, match="no Docker engine"):
        layer.provide(tmp_path)
    monkeypatch.setenv("EPD_TEST_SERVICES", "env")
    monkeypatch.setenv("EPD_KAFKA_BOOTSTRAP", f"127.0.0.1:{services.free_port()}")
    with pytest.raises(layer.ServicesUnavailable, match="does not answer"):
        layer.provide(tmp_path)


def test_tansu_only_settings_only_for_tansu() -> None:
    tansu = layer.settings_env("127.0.0.1:9", "redis://127.0.0.1:6/0", tansu=True)
    kafka = layer.settings_env("127.0.0.1:9", "redis://127.0.0.1:6/0", tansu=False)
    assert tansu["EPD_KAFKA_IDEMPOTENCE"] == "false" and tansu["EPD_KAFKA_FETCH_MAX_WAIT_MS"]
    assert kafka["EPD_KAFKA_IDEMPOTENCE"] == "true"
    assert not {k for k in kafka if "TIMEOUT" in k or "FETCH" in k or "HEARTBEAT" in k}


@pytest.mark.tansu
async def test_events_and_values_cross_the_services(settings: Settings) -> None:
    import redis.asyncio as aioredis

    topic = f"layer-{services.free_port()}.encode"
    await ensure_topics(settings, [topic], partitions=2)
    pixels = torch.randn(64, 1176, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    ec = ECTransfer("h" * 64, settings.redis_url, "ec:tiny:" + "h" * 64, 1 << 41, "ab" * 32)
    events = [
        EncodeEvent("r1", "tiny", "image", 0, "h" * 64, {"pixel_values": pixels}, ec),
        ResultEvent("r1", "encode", "completed", timings={"encode": 2.0}),
    ]
    producer = make_producer(settings)
    await producer.start()
    try:
        for ev in events:
            await KafkaPublisher(producer).send(topic, "r1", ev)
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
    got = codec.decode(records[0].value, EncodeEvent).data["pixel_values"]
    assert isinstance(got, torch.Tensor) and got.dtype == torch.bfloat16
    assert torch.equal(got, pixels)
    assert codec.decode(records[1].value, ResultEvent).timings == {"encode": 2.0}

    client = aioredis.Redis.from_url(settings.redis_url)
    key = f"test:layer:{services.free_port()}"
    try:
        raw = pixels.view(torch.int16).numpy().tobytes()
        await client.set(key, raw, ex=60)
        back = await client.get(key)
        await client.delete(key)
    finally:
        await client.aclose()
    assert back == raw


@pytest.mark.tansu
def test_faults_act_on_the_services(test_services: layer.TestServices) -> None:
    """Pause makes Redis stop answering, unpause brings it back; restart empties it."""
    if not test_services.redis.controllable:
        pytest.skip(f"services are not ours to fault in mode {test_services.mode}")
    import redis

    url = test_services.redis.address
    client = redis.Redis.from_url(url, socket_timeout=0.5)
    try:
        client.set("test:layer:fault", b"1")
        assert test_services.redis.pause is not None and test_services.redis.unpause is not None
        test_services.redis.pause()
        try:
            assert not services.redis_answers(url, timeout_s=0.5)
        finally:
            test_services.redis.unpause()
        assert services.redis_answers(url) and client.get("test:layer:fault") == b"1"
        assert test_services.redis.restart is not None
        test_services.redis.restart()
        assert services.redis_answers(url)
        client.connection_pool.disconnect()
        assert client.get("test:layer:fault") is None  # restarted empty, same address
    finally:
        client.close()


@pytest.mark.tansu
async def test_a_broker_restart_keeps_apache_kafkas_log_and_empties_tansu(
    settings: Settings, test_services: layer.TestServices
) -> None:
    """``kafka.restart(hard=True)``: SIGKILL, then the same address; Apache Kafka comes back
    with its log directory (the records are still there), Tansu empty (memory storage)."""
    handle = test_services.kafka
    if handle.restart is None:
        pytest.skip(f"the broker is not ours to restart in mode {test_services.mode}")
    topic = f"layer-{uuid.uuid4().hex[:8]}"
    await ensure_topics(settings, [topic], partitions=1)
    producer = make_producer(settings)
    await producer.start()
    try:
        for i in range(3):
            await producer.send_and_wait(topic, value=f"v{i}".encode(), key=b"k")
    finally:
        await producer.stop()
    await asyncio.to_thread(handle.restart, 0.0, hard=True)
    assert services.kafka_answers(handle.address)
    values = [r.value for r in await read_topic(settings, topic)]
    if test_services.kafka_is_tansu:
        assert values == []
    else:
        assert values == [b"v0", b"v1", b"v2"]


def test_compose_file_is_a_valid_stack() -> None:
    """docker-compose.yml: Kafka in KRaft mode, Redis and the pipeline services, all on the
    host network, GPU workers with an nvidia reservation, configuration through EPD_*, and
    every service command a real ``epd`` sub-command."""
    spec = yaml.safe_load(COMPOSE_FILE.read_text())
    svcs = spec["services"]
    assert {"kafka", "redis", "router", "encode", "prefill", "results", "api"} <= set(svcs)
    assert default(svcs["kafka"]["image"]).startswith("apache/kafka")
    assert "controller" in svcs["kafka"]["environment"]["KAFKA_PROCESS_ROLES"]
    for name, svc in svcs.items():
        assert svc.get("network_mode") == "host", f"{name} must use host networking"
        assert "ports" not in svc, f"{name} must not publish ports through a bridge"
    for name in ("encode", "prefill"):
        devices = svcs[name]["deploy"]["resources"]["reservations"]["devices"]
        assert any(d.get("driver") == "nvidia" and "gpu" in d["capabilities"] for d in devices)
    parser = build_parser()
    for name in ("topics", "router", "encode", "prefill", "results", "api"):
        env = svcs[name]["environment"]
        assert env["EPD_KAFKA_BOOTSTRAP"] and env["EPD_REDIS_URL"], name
        assert svcs[name]["build"]["dockerfile"] == "docker/Dockerfile"
        # the image's entrypoint is `epd`: the command must parse as one of its sub-commands
        args = parser.parse_args([default(arg) for arg in svcs[name]["command"]])
        assert callable(args.func), name
    # the API is healthy only when ready (broker, Redis, topics)
    assert "/readyz" in " ".join(svcs["api"]["healthcheck"]["test"])


def test_compose_runs_the_broker_the_tests_run() -> None:
    """The production stack's Apache Kafka is the version and single-node policy of the one
    the suite, the fault tests and the benchmark run (epd.services.kafka)."""
    from epd.services import kafka

    svc = yaml.safe_load(COMPOSE_FILE.read_text())["services"]["kafka"]
    assert svc["image"] == f"${{EPD_KAFKA_IMAGE:-apache/kafka:{kafka.KAFKA_VERSION}}}"
    ours = kafka.server_properties(
        port=1,
        controller_port=2,
        log_dir="/x",
        max_message_bytes=Settings().max_message_bytes,
        partitions=4,
    )
    env = svc["environment"]
    for key in kafka.SHARED_WITH_COMPOSE:
        name = "KAFKA_" + key.replace(".", "_").upper()
        assert str(env.get(name)) == ours[key], (
            f"{name}: compose {env.get(name)!r}, tests {ours[key]!r}"
        )


def test_compose_runs_the_benchmarks_jvm() -> None:
    """The production stack's broker JVM is the production profile the benchmarks measure
    (epd.services.kafka.JVM_PROFILES): the same heap and the same flags, as the defaults of the
    variables the official image's start scripts read."""
    from epd.services import kafka

    env = yaml.safe_load(COMPOSE_FILE.read_text())["services"]["kafka"]["environment"]

    def variable_default(name: str) -> str:
        found = re.fullmatch(r"\$\{(\w+):-(.*)\}", env[name])
        assert found and found.group(1) == name, env[name]
        return found.group(2)

    production = kafka.JVM_PROFILES["production"]
    assert variable_default("KAFKA_HEAP_OPTS").split() == production.heap_options()
    assert variable_default("KAFKA_JVM_PERFORMANCE_OPTS").split() == list(production.flags)


@pytest.mark.skipif(shutil.which("docker-compose") is None, reason="docker-compose not installed")
def test_compose_file_parses_with_docker_compose() -> None:
    proc = subprocess.run(
        ["docker-compose", "-f", str(COMPOSE_FILE), "config", "-q"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=False,
        # The stack has no default secret (see test_compose_requires_a_secret).
        env={**os.environ, "EPD_EC_SECRET": "compose-config-test-secret"},
    )
    assert proc.returncode == 0, proc.stderr


def test_compose_names_its_images_through_variables_with_the_public_defaults() -> None:
    """A machine without a registry passes local images (the compose test); unset, the stack
    runs the public ones, and the app image's base is docker/Dockerfile's own default."""
    svcs = yaml.safe_load(COMPOSE_FILE.read_text())["services"]
    assert svcs["redis"]["image"] == "${EPD_REDIS_IMAGE:-redis:7.4}"
    dockerfile = (ROOT / "docker" / "Dockerfile").read_text()
    base = re.search(r"^ARG BASE_IMAGE=(\S+)$", dockerfile, re.M)
    assert base and "FROM ${BASE_IMAGE}" in dockerfile
    for name in ("topics", "router", "encode", "prefill", "results", "api"):
        assert svcs[name]["image"] == "${EPD_IMAGE:-epd-pipeline:latest}", name
        assert svcs[name]["build"]["args"]["BASE_IMAGE"] == f"${{EPD_BASE_IMAGE:-{base[1]}}}"
    # scaled workers share the host network: nothing may pin a name or a port
    for name in ("encode", "prefill"):
        assert "container_name" not in svcs[name]
        assert not any("port" in arg for arg in svcs[name]["command"]), name


def test_the_cpu_override_drops_only_the_gpu_reservations() -> None:
    """docker/compose.cpu.yml merged as Compose merges it: the workers lose their NVIDIA
    reservation and run on the CPU in fp32; everything else is the production file's."""
    from tests.integration.compose_stack import apply_override, load_override

    prod = yaml.safe_load(COMPOSE_FILE.read_text())
    cpu = apply_override(prod, load_override())
    for name in ("encode", "prefill"):
        assert "deploy" in prod["services"][name] and "deploy" not in cpu["services"][name]
        assert cpu["services"][name]["environment"]["EPD_DEVICE"] == "cpu"
        rest = {k: v for k, v in cpu["services"][name].items() if k != "environment"}
        assert rest == {
            k: v for k, v in prod["services"][name].items() if k not in ("deploy", "environment")
        }
    for name in ("encode", "prefill", "api", "router"):
        env = cpu["services"][name]["environment"]
        assert env["EPD_PIXEL_DTYPE"] == "fp32"
        assert env["EPD_EC_SECRET"] == prod["services"][name]["environment"]["EPD_EC_SECRET"]
    assert cpu["services"]["kafka"] == prod["services"]["kafka"]
