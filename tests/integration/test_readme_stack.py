"""The newcomer's path, as the README writes it: ``epd stack`` started from a fresh clone of
this branch, the README's HTTP section run as written (its curl block in bash, its Python
block in a fresh interpreter), then Ctrl-C stops everything the stack started."""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil
import pytest

from media.sample_images import png_bytes, synthetic_image
from tests.integration.api_stack import free_port

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
READY_S = 420.0


def http_section_blocks(title: str = "HTTP API") -> dict[str, list[str]]:
    """The fenced code blocks of a README section ("HTTP API" unless named), by language."""
    text = (REPO / "README.md").read_text()
    section = text.split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]
    blocks: dict[str, list[str]] = {}
    for lang, body in re.findall(r"```(\w+)\n(.*?)```", section, flags=re.S):
        blocks.setdefault(lang, []).append(body)
    return blocks


@dataclass
class Stack:
    proc: subprocess.Popen[str]
    url: str
    clone: Path
    work: Path
    env: dict[str, str]
    output: list[str]
    started: list[psutil.Process]


def fresh_env(clone: Path, state: Path, port: int) -> dict[str, str]:
    """This environment without any EPD_* setting (the fixtures export the test services'),
    the clone on the path, and the API port the README's EPD_API_URL points at."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("EPD_")}
    env.update(
        {
            "PYTHONPATH": str(clone),
            "EPD_STATE_DIR": str(state),
            "EPD_API_PORT": str(port),
            "EPD_API_URL": f"http://127.0.0.1:{port}",
            "PYTHONUNBUFFERED": "1",
        }
    )
    return env


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    root = tmp_path_factory.mktemp("newcomer")
    clone = root / "epd-pipeline"
    subprocess.run(["git", "clone", "--quiet", str(REPO), str(clone)], check=True, timeout=120)
    work = root / "work"
    work.mkdir()
    (work / "cat.png").write_bytes(png_bytes(synthetic_image(112, 84, seed=7)))
    port = free_port()
    env = fresh_env(clone, root / "state", port)
    [command] = [b.strip() for b in http_section_blocks()["bash"] if b.strip().startswith("epd ")]
    argv = shlex.split(command)
    assert argv[:2] == ["epd", "stack"], command
    proc = subprocess.Popen(
        [sys.executable, "-m", "epd.cli", *argv[1:], "--port", str(port)],
        cwd=clone,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    output: list[str] = []
    deadline = time.monotonic() + READY_S
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            output.append(line)
            if "epd stack: ready:" in line:
                break
            assert time.monotonic() < deadline, "".join(output)
        assert any("ready:" in ln for ln in output), "".join(output)
        started = psutil.Process(proc.pid).children(recursive=True)
        yield Stack(proc, f"http://127.0.0.1:{port}", clone, work, env, output, started)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(60)
        if proc.poll() is None:
            proc.kill()


def test_the_stack_starts_from_a_fresh_clone_and_says_ready(stack: Stack) -> None:
    text = "".join(stack.output)
    print(f"\nEPD STACK (fresh clone {stack.clone}):\n{text}")
    assert "generated an EC secret" in text and "workers" in text
    kinds = {" ".join(p.cmdline()[3:5]) for p in stack.started if "epd.cli" in p.cmdline()}
    assert {"worker results", "worker encode", "worker prefill", "worker router"} <= kinds


def _stack_says(stack: Stack, words: str, timeout_s: float) -> str:
    """The stack's next console line holding ``words`` (lines before it are kept)."""
    assert stack.proc.stdout is not None
    deadline = time.monotonic() + timeout_s
    for line in stack.proc.stdout:
        stack.output.append(line)
        if words in line:
            return line
        assert time.monotonic() < deadline, "".join(stack.output[-20:])
    raise AssertionError(f"the stack ended without saying {words!r}")


def test_a_killed_worker_is_said_restarted_and_readyz_shows_the_gap(stack: Stack) -> None:
    """kill -9 of the prefill worker: the stack says so and starts it again; /readyz answers
    503 naming the missing stage until it is back, then 200 (the README blocks below then run
    on the restarted worker)."""
    [victim] = [p for p in stack.started if p.cmdline()[3:5] == ["worker", "prefill"]]
    killed = time.monotonic()
    victim.send_signal(signal.SIGKILL)
    gap = None
    while time.monotonic() - killed < 30:
        ready = httpx.get(f"{stack.url}/readyz", timeout=5)
        if ready.status_code == 503:
            gap = ready.json()["checks"]["workers"]
            break
        time.sleep(0.1)
    assert gap is not None and gap.startswith("no live prefill worker (last seen"), gap
    said = _stack_says(stack, "restarting it in", 30)
    assert "the prefill worker exited with -9" in said, said
    _stack_says(stack, "the prefill worker is back", READY_S)
    while httpx.get(f"{stack.url}/readyz", timeout=5).status_code != 200:
        assert time.monotonic() - killed < READY_S
        time.sleep(0.2)
    back_s = time.monotonic() - killed
    new = [p for p in psutil.Process(stack.proc.pid).children(recursive=True)]
    stack.started.extend(p for p in new if p.pid not in {q.pid for q in stack.started})
    print(f"\nkill -9 prefill: 503 {gap!r}; ready again after {back_s:.1f} s")


def test_the_readme_curl_block_runs_as_written(stack: Stack) -> None:
    [curl] = [b for b in http_section_blocks()["bash"] if "curl" in b]
    run = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", curl],
        cwd=stack.work,
        env=stack.env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    print(f"\nREADME curl block:\n{run.stdout[-3000:]}")
    assert run.returncode == 0, run.stderr + run.stdout
    assert '"status":"completed"' in run.stdout.replace(" ", "")  # the event stream's outcome
    assert "already_finished" in run.stdout or '"status":"cancelled"' in run.stdout


def test_the_readme_python_block_runs_as_written(stack: Stack) -> None:
    [block] = http_section_blocks()["python"]
    script = stack.work / "readme_client.py"
    script.write_text(block)
    run = subprocess.run(
        [sys.executable, str(script)],
        cwd=stack.work,
        env=stack.env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    print(f"\nREADME python block:\n{run.stdout}")
    assert run.returncode == 0, run.stderr
    lines = run.stdout.split()
    assert lines[0] == "queued" and lines.count("completed") >= 2  # the wait and the run


def test_the_readme_openai_block_runs_as_written(stack: Stack) -> None:
    [block] = http_section_blocks("OpenAI-compatible API")["python"]
    script = stack.work / "readme_openai.py"
    script.write_text(block)
    run = subprocess.run(
        [sys.executable, str(script)],
        cwd=stack.work,
        env=stack.env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    print(f"\nREADME openai block:\n{run.stdout!r}")
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert lines[0].split()[0] in ("stop", "length")  # the finish reason, then the usage
    assert "same seed, same text: True" in lines
    assert lines[-2].startswith("completed ") and lines[-1] == "cancelled"


def test_ctrl_c_stops_everything_the_stack_started(stack: Stack) -> None:
    alive = [p for p in stack.started if p.is_running()]
    assert alive, "the stack had started no process?"
    stack.proc.send_signal(signal.SIGINT)
    assert stack.proc.wait(90) == 0, "".join(stack.output)
    rest = stack.proc.stdout.read() if stack.proc.stdout else ""
    print(f"\nCTRL-C:\n{rest}")
    _, left = psutil.wait_procs(alive, timeout=30)
    assert not left, [(p.pid, p.cmdline()) for p in left]
    assert "epd stack: stopped" in rest
