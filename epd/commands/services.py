"""``epd up``, ``epd down``, ``epd env`` and ``epd services run|status``: local services."""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from epd import services


def _info(msg: str) -> None:
    # Status goes to stderr so stdout stays clean for ``eval "$(epd up)"``.
    print(f"epd: {msg}", file=sys.stderr)


def _describe(rec: services.ServiceRecord) -> str:
    how = f"started pid {rec.pid}, log {rec.log}" if rec.started else "already running, reused"
    what = f"{rec.name} ({services.describe(rec.kind)})" if rec.kind else rec.name
    return f"{what} at {rec.address} ({how})"


def _report(state: services.ServicesState) -> None:
    for note in state.notes:
        _info(note)
    _info(_describe(state.kafka))
    if state.redis_nodes:
        pids = ", ".join(f"{n.address} (pid {n.pid})" for n in state.redis_nodes)
        _info(f"redis cluster at {state.redis.address}: nodes {pids}")
    else:
        _info(_describe(state.redis))


def cmd_up(args: argparse.Namespace) -> int:
    """Start (or reuse) Kafka and Redis, record them, print the env lines."""
    try:
        state, _ = services.up(
            args.state_dir,
            kafka_port=args.kafka_port,
            redis_cluster=args.redis_cluster,
            redis_replicas=args.redis_replicas,
        )
    except services.ServiceError as exc:
        _info(f"error: {exc}")
        return 2 if isinstance(exc, services.KafkaJarsUnavailable) else 1
    _report(state)
    print("\n".join(services.shell_lines(state.env, export=not args.plain)))
    return 0


def cmd_down(args: argparse.Namespace) -> int:
    """Stop what ``epd up`` started (and nothing else)."""
    directory = services.state_dir(args.state_dir)
    if services.load_state(directory) is None:
        _info(f"nothing recorded in {directory}; nothing to stop")
        return 0
    stopped = services.down(directory)
    for rec in stopped:
        _info(f"stopped {rec.name} (pid {rec.pid})")
    if not stopped:
        _info("no running service was started by epd up; nothing stopped")
    return 0


def cmd_env(args: argparse.Namespace) -> int:
    """Print the recorded env lines; exit 1 when ``epd up`` has not run here."""
    directory = services.state_dir(args.state_dir)
    state = services.load_state(directory)
    if state is None:
        _info(f"no services recorded in {directory}; run `epd up` first")
        return 1
    print("\n".join(services.shell_lines(state.env, export=not args.plain)))
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    """Show what is recorded and whether each service answers; exit 1 if one does not."""
    directory = services.state_dir(args.state_dir)
    state = services.load_state(directory)
    if state is None:
        print(f"no services recorded in {directory}")
        return 1
    ok = True
    for rec, probe in (
        (state.kafka, services.kafka_answers),
        (state.redis, services.redis_answers),
    ):
        up = probe(rec.address)
        ok &= up
        owner = f"pid {rec.pid}" if rec.started else "external"
        if rec is state.redis and state.redis_nodes:
            owner = f"{len(state.redis_nodes)} nodes"
        print(f"{rec.name:6} {rec.address:32} {owner:12} {'up' if up else 'DOWN'}")
    return 0 if ok else 1


def cmd_run(args: argparse.Namespace) -> int:
    """Run a command with the services up; stop only what this invocation started."""
    cmd = list(args.cmd)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        _info("error: nothing to run; usage: epd services run -- COMMAND [ARGS...]")
        return 2
    if shutil.which(cmd[0]) is None and not Path(cmd[0]).exists():
        _info(f"error: command not found: {cmd[0]}")
        return 127
    directory = services.state_dir(args.state_dir)
    directory.mkdir(parents=True, exist_ok=True)
    log_dir = Path(tempfile.mkdtemp(prefix="run-", dir=directory))
    try:
        state, started = services.up(
            directory,
            kafka_port=args.kafka_port,
            record=False,
            log_dir=log_dir,
            tie_to_parent=True,  # if this runner is killed, what it started dies too
            redis_cluster=args.redis_cluster,
            redis_replicas=args.redis_replicas,
        )
    except services.ServiceError as exc:
        _info(f"error: {exc}")
        return 2 if isinstance(exc, services.KafkaJarsUnavailable) else 1
    _report(state)
    env = {**os.environ, **state.env}
    code = 1
    try:
        proc = subprocess.Popen(cmd, env=env)
        # Forward SIGTERM so the command can shut down cleanly before the services stop.
        signal.signal(signal.SIGTERM, lambda *_: proc.send_signal(signal.SIGTERM))
        try:
            code = proc.wait()
        except KeyboardInterrupt:
            proc.send_signal(signal.SIGINT)
            code = proc.wait()
    finally:
        services.stop_records(started)
        if code == 0:
            shutil.rmtree(log_dir, ignore_errors=True)
        elif started:
            _info(f"service logs kept in {log_dir}")
        else:
            shutil.rmtree(log_dir, ignore_errors=True)
    # A signal death reads as 128+N, as a shell reports it.
    return code if code >= 0 else 128 - code


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--state-dir",
        type=Path,
        default=None,
        help="where pids, ports and logs are recorded (default $EPD_STATE_DIR or ./.epd)",
    )


def _masters(text: str) -> int:
    n = int(text)
    if n < 3:
        raise argparse.ArgumentTypeError("a Redis Cluster needs at least 3 masters")
    return n


def _redis_cluster_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--redis-cluster",
        type=_masters,
        default=0,
        metavar="N",
        help="start a local Redis Cluster of N masters (N >= 3) instead of one redis-server; "
        "EPD_REDIS_URL and EPD_STORE_URL then name it (redis+cluster://)",
    )
    p.add_argument(
        "--redis-replicas",
        type=int,
        choices=range(0, 4),
        default=0,
        metavar="R",
        help="replicas per master of --redis-cluster (0-3, default 0)",
    )


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add ``up``, ``down``, ``env`` and ``services`` to the CLI."""

    def add_up(p: argparse.ArgumentParser) -> None:
        _common(p)
        p.add_argument(
            "--kafka-port",
            type=int,
            default=None,
            help="the embedded broker's port (default: $EPD_KAFKA_PORT, else free)",
        )
        _redis_cluster_flags(p)
        p.add_argument("--plain", action="store_true", help="print K=V lines without 'export'")
        p.set_defaults(func=cmd_up)

    def add_down(p: argparse.ArgumentParser) -> None:
        _common(p)
        p.set_defaults(func=cmd_down)

    def add_env(p: argparse.ArgumentParser) -> None:
        _common(p)
        p.add_argument("--plain", action="store_true", help="print K=V lines without 'export'")
        p.set_defaults(func=cmd_env)

    add_up(
        sub.add_parser(
            "up",
            help="start a local Kafka broker (EPD_BROKER) and Redis; print env lines",
        )
    )
    add_down(sub.add_parser("down", help="stop what `epd up` started"))
    add_env(sub.add_parser("env", help='print the env lines of `epd up` (eval "$(epd env)")'))

    svc = sub.add_parser("services", help="local Kafka broker and Redis for tests and the demo")
    svc_sub = svc.add_subparsers(dest="services_command", metavar="ACTION", required=True)
    add_up(svc_sub.add_parser("up", help="same as `epd up`"))
    add_down(svc_sub.add_parser("down", help="same as `epd down`"))
    add_env(svc_sub.add_parser("env", help="same as `epd env`"))
    status = svc_sub.add_parser("status", help="what is recorded and whether it answers")
    _common(status)
    status.set_defaults(func=cmd_status)
    run = svc_sub.add_parser(
        "run",
        help="run COMMAND with the services up and EPD_* exported; stop what this run started",
    )
    _common(run)
    run.add_argument("--kafka-port", type=int, default=None)
    _redis_cluster_flags(run)
    run.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- COMMAND [ARGS...]")
    run.set_defaults(func=cmd_run)
