"""A local Redis Cluster: ``masters x (1 + replicas)`` ``redis-server --cluster-enabled yes``
processes on 127.0.0.1, formed with ``redis-cli --cluster create`` (no persistence).

What ``epd up --redis-cluster N`` and the test fixtures start. The cluster's URL is
``redis+cluster://`` with every node as a seed; each node is a :class:`ServiceRecord` of its
own, so a stop ends exactly these processes and a fault test can kill one master.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from epd.services.processes import (
    free_port,
    pid_alive,
    port_open,
    spawn,
    stop_process,
    wait_until,
)
from epd.services.state import ServiceError, ServiceRecord

NODE_TIMEOUT_MS = 2000
"""How long a master may not answer before the others vote it failed and promote its replica
(Redis's default is 15 s; a local cluster fails over quickly)."""
CLUSTER_INSTALL_HINT = (
    "redis-server and redis-cli are needed for a local Redis Cluster (Debian/Ubuntu: "
    "`apt-get install redis-server redis-tools`)"
)


@dataclass(slots=True)
class RedisClusterNodes:
    """A started local cluster: its URL and one record per node process."""

    url: str
    nodes: list[ServiceRecord] = field(default_factory=list)
    masters: int = 0
    replicas: int = 0

    @property
    def addresses(self) -> list[str]:
        return [n.address for n in self.nodes]


def _node_command(
    binary: str, port: int, bus_port: int, directory: Path, node_timeout_ms: int
) -> list[str]:
    return [
        binary,
        "--bind",
        "127.0.0.1",
        "--port",
        str(port),
        "--cluster-enabled",
        "yes",
        # The bus port is chosen, not port + 10000 (which a free high port would overflow).
        "--cluster-port",
        str(bus_port),
        "--cluster-config-file",
        f"nodes-{port}.conf",
        "--cluster-node-timeout",
        str(node_timeout_ms),
        "--save",
        "",
        "--appendonly",
        "no",
        "--dir",
        str(directory.resolve()),
    ]


def cluster_ok(cli: str, address: str, nodes: int) -> bool:
    """Whether the node at ``address`` sees a healthy cluster of ``nodes`` nodes."""
    host, _, port = address.rpartition(":")
    try:
        info = subprocess.run(
            [cli, "-h", host, "-p", port, "cluster", "info"],
            capture_output=True,
            text=True,
            timeout=5,
            check=False,
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return False
    fields = dict(line.split(":", 1) for line in info.split() if ":" in line)
    return fields.get("cluster_state") == "ok" and fields.get("cluster_known_nodes") == str(nodes)


def start_redis_cluster(
    directory: Path,
    masters: int = 3,
    replicas: int = 0,
    *,
    log_dir: Path | None = None,
    node_timeout_ms: int = NODE_TIMEOUT_MS,
    tie_to_parent: bool = False,
    timeout_s: float = 30.0,
) -> RedisClusterNodes:
    """Start and form a cluster of ``masters`` masters with ``replicas`` replicas each.

    ``redis-cli --cluster create`` forms clusters of 3 masters or more; a smaller one (the
    benchmarks' 1-master cluster, replicas 0) is formed by hand: the nodes meet and split the
    slots between them (``CLUSTER MEET``, ``CLUSTER ADDSLOTSRANGE``)."""
    if masters < 1 or (masters < 3 and replicas):
        raise ServiceError("a Redis Cluster needs 3 masters or more for replicas (1 without)")
    binary, cli = shutil.which("redis-server"), shutil.which("redis-cli")
    if binary is None or cli is None:
        raise ServiceError(CLUSTER_INSTALL_HINT)
    directory.mkdir(parents=True, exist_ok=True)
    started: list[ServiceRecord] = []
    try:
        for _ in range(masters * (1 + replicas)):
            started.append(_spawn_node(binary, directory, log_dir, node_timeout_ms, tie_to_parent))
        for rec in started:
            _await_port(rec, timeout_s)
        if masters >= 3:
            _form(cli, started, replicas, timeout_s)
        else:
            _form_by_hand(cli, started, timeout_s)
    except BaseException:
        for rec in started:
            stop_process(rec.pid, rec.command)
        raise
    url = "redis+cluster://" + ",".join(r.address for r in started)
    return RedisClusterNodes(url, started, masters, replicas)


def _spawn_node(
    binary: str, directory: Path, log_dir: Path | None, node_timeout_ms: int, tie: bool
) -> ServiceRecord:
    port, bus_port = free_port(), free_port()
    node_dir = directory / f"node-{port}"
    node_dir.mkdir(parents=True, exist_ok=True)
    cmd = _node_command(binary, port, bus_port, node_dir, node_timeout_ms)
    log = (log_dir or directory) / f"redis-cluster-{port}.log"
    proc = spawn(cmd, log, cwd=node_dir, tie_to_parent=tie)
    return ServiceRecord("redis-node", f"127.0.0.1:{port}", True, proc.pid, cmd, str(log))


def _await_port(rec: ServiceRecord, timeout_s: float) -> None:
    port = int(rec.address.rsplit(":", 1)[1])

    def listening() -> bool:
        return port_open("127.0.0.1", port)

    if not wait_until(listening, timeout_s, alive=lambda: pid_alive(rec.pid, rec.command)):
        raise ServiceError(f"redis cluster node {rec.address} did not start; see {rec.log}")


def _form(cli: str, nodes: list[ServiceRecord], replicas: int, timeout_s: float) -> None:
    """``redis-cli --cluster create``, then wait until every node sees all of them, ``ok``."""
    addresses = [r.address for r in nodes]
    formed = subprocess.run(
        [
            cli,
            "--cluster",
            "create",
            *addresses,
            "--cluster-replicas",
            str(replicas),
            "--cluster-yes",
        ],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )
    if formed.returncode != 0:
        raise ServiceError(f"redis-cli --cluster create failed:\n{formed.stdout}{formed.stderr}")
    deadline = time.monotonic() + timeout_s
    while not all(cluster_ok(cli, r.address, len(nodes)) for r in nodes):
        if time.monotonic() > deadline:
            raise ServiceError(f"the Redis Cluster on {nodes[0].address} did not settle")
        time.sleep(0.2)


def _form_by_hand(cli: str, nodes: list[ServiceRecord], timeout_s: float) -> None:
    """Meet the nodes and give each an even share of the slots (no replicas)."""

    def call(address: str, *args: str) -> None:
        host, _, port = address.rpartition(":")
        done = subprocess.run(
            [cli, "-h", host, "-p", port, *args],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
        if done.returncode != 0 or "ERR" in done.stdout:
            raise ServiceError(f"{' '.join(args)} on {address}: {done.stdout}{done.stderr}")

    first_host, _, first_port = nodes[0].address.rpartition(":")
    share = 16384 // len(nodes)
    for i, rec in enumerate(nodes):
        if i:
            call(rec.address, "cluster", "meet", first_host, first_port)
        last = 16383 if i == len(nodes) - 1 else (i + 1) * share - 1
        call(rec.address, "cluster", "addslotsrange", str(i * share), str(last))
    deadline = time.monotonic() + timeout_s
    while not all(cluster_ok(cli, r.address, len(nodes)) for r in nodes):
        if time.monotonic() > deadline:
            raise ServiceError(f"the Redis Cluster on {nodes[0].address} did not settle")
        time.sleep(0.2)


def stop_redis_cluster(cluster: RedisClusterNodes) -> None:
    """Stop every node process of ``cluster``."""
    for rec in cluster.nodes:
        stop_process(rec.pid, rec.command)
