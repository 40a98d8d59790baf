"""The pipeline on a real Redis Cluster: ``epd up --redis-cluster N`` as a user runs it, and
``epd demo`` end to end with ``EPD_STORE_URL`` and ``EPD_REDIS_URL`` on three masters (keys
counted per master)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from epd.services import free_port, pid_alive, redis_answers
from runtime.redis.cluster import ClusterURL
from runtime.settings import Settings

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
EPD = [sys.executable, "-m", "epd.cli"]


def _run(
    args: list[str], env: dict[str, str], timeout: float = 540
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        EPD + args,
        env={**env, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
        check=False,
    )


def _lines(stdout: str) -> dict[str, str]:
    pairs = (
        line.removeprefix("export ").split("=", 1) for line in stdout.splitlines() if "=" in line
    )
    return {k: v.strip("'") for k, v in pairs}


def test_epd_up_redis_cluster_starts_one_and_down_stops_every_node(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("EPD_")}
    env.update(
        EPD_STATE_DIR=str(tmp_path / "state"), EPD_BROKER="tansu", EPD_KAFKA_PORT=str(free_port())
    )
    up = _run(["up", "--redis-cluster", "3", "--redis-replicas", "1"], env, timeout=120)
    try:
        assert up.returncode == 0, up.stderr
        lines = _lines(up.stdout)
        url = lines["EPD_REDIS_URL"]
        assert url.startswith("redis+cluster://") and lines["EPD_STORE_URL"] == url
        assert len(ClusterURL.parse(url).seeds) == 6  # three masters, one replica each
        assert redis_answers(url)
        assert "redis cluster at redis+cluster://" in up.stderr
        again = _run(["up", "--redis-cluster", "3", "--redis-replicas", "1"], env, timeout=120)
        assert again.returncode == 0 and _lines(again.stdout) == lines  # reused
        status = _run(["services", "status"], env, timeout=60)
        assert status.returncode == 0 and "6 nodes" in status.stdout, status.stdout
        state = json.loads((tmp_path / "state" / "services.json").read_text())
        pids = [n["pid"] for n in state["redis_nodes"]]
        assert len(pids) == 6 and all(pid_alive(p) for p in pids)
        single = _run(["up"], env, timeout=60)  # the other kind while this one runs: refused
        assert single.returncode != 0 and "epd down" in single.stderr
    finally:
        down = _run(["down"], env, timeout=120)
    assert down.returncode == 0, down.stderr
    assert down.stderr.count("stopped redis-node") == 6
    assert not any(pid_alive(p) for p in pids)
    assert not redis_answers(url)
    bad = _run(["up", "--redis-cluster", "2"], env, timeout=60)
    assert bad.returncode == 2 and "at least 3 masters" in bad.stderr


def test_demo_on_a_three_master_cluster(
    settings: Settings, redis_cluster: Any, tmp_path: Path
) -> None:
    """``epd demo`` with the embeddings and the status records on the cluster: every request
    completes, and both kinds of key land on more than one master."""
    env = {
        **os.environ,  # the settings fixture exported the test broker
        "EPD_STATE_DIR": str(tmp_path / "state"),
        "EPD_REDIS_URL": redis_cluster.url,
        "EPD_STORE_URL": redis_cluster.url,
    }
    proc = _run(["demo", "--json", "--max-tokens", "4"], env)
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-3000:]
    summary = json.loads(proc.stdout)
    assert summary["completed"] == summary["requests"] > 0, summary["not_completed"]
    embeddings = redis_cluster.keys_per_master("ec-*")  # the demo's own namespace, ec-<run>
    records = redis_cluster.keys_per_master("epd-*:status:{*}")  # hash-tagged, epd-<run>:...
    tokens = redis_cluster.keys_per_master("epd-*:tokens:{*}")
    print(
        f"\ndemo on a 3-master cluster: embeddings per master {embeddings}, "
        f"status records per master {records}, token streams per master {tokens}, "
        f"{summary['requests']} requests"
    )
    assert sum(1 for n in embeddings.values() if n) > 1, embeddings
    assert sum(1 for n in records.values() if n) > 1, records
    assert sum(records.values()) >= summary["requests"]
    assert sum(tokens.values()) >= summary["requests"], tokens  # every request decoded
    # Every key of one request sits beside its record: one hash tag, one slot, one master.
    for addr in redis_cluster.masters():
        here = {
            kind: {_tag(k) for k in redis_cluster.keys_on(addr, f"epd-*:{kind}:{{*}}")}
            for kind in ("status", "status-events", "tokens")
        }
        assert here["tokens"] <= here["status"] and here["status-events"] <= here["status"], addr


def _tag(key: bytes) -> bytes:
    """The ``{hash tag}`` of a key."""
    return key[key.index(b"{") : key.index(b"}") + 1]
