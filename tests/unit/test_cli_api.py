"""``epd api``, ``epd submit``, ``epd status``, ``epd cancel``: registered, with help that
explains each; an unreachable API is exit 2 with a message, not a traceback."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from epd.cli import build_parser, main
from tests.integration.api_stack import free_port


@pytest.mark.parametrize(
    ("command", "words"),
    [
        ("api", ["POST   /v1/requests", "EPD_API_TOKENS", "--workers"]),
        ("submit", ["<image>", "--wait", "stage by stage", "Exit status"]),
        ("status", ["stage timings", "--wait"]),
        ("cancel", ["cancelled", "skip", "exit 1"]),
    ],
)
def test_help_explains_each_command(
    command: str, words: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args([command, "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for w in words:
        assert w in out, (command, w)


def test_unreachable_api_is_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    assert main(["status", "abc", "--url", url]) == 2
    assert "cannot reach the API" in capsys.readouterr().err


# ------------------------------------------------------------ settings refused at start-up

SECRET = "0123456789abcdef0123456789abcdef"


@pytest.mark.parametrize(
    ("tokens", "words"),
    [
        (",", "names no token"),
        (" , ", "names no token"),
        ("", "names no token"),
        ("sekrit-one=alice,,sekrit-two=bob", "entry 2 is empty"),
        ("sekrit-one=alice,sekrit-one=bob", "entry 2 (tenant 'bob') repeats the token of entry 1"),
        ("=alice", "entry 1 (tenant 'alice') has an empty token"),
        ("sekrit-one=", "entry 1 is not TOKEN=TENANT"),
        ("sekrit-one", "entry 1 is not TOKEN=TENANT"),
        ("sek rit=alice", "entry 1 (tenant 'alice') has a token with spaces"),
        ("sekrit-one=al ice", "entry 1 has an invalid tenant name"),
    ],
)
def test_malformed_tokens_refuse_to_start_the_api(
    tokens: str,
    words: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv("EPD_EC_SECRET", SECRET)
    monkeypatch.setenv("EPD_API_TOKENS", tokens)
    assert main(["api", "--port", str(free_port())]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert err.startswith("epd: EPD_API_TOKENS") and words in err, err
    assert "sekrit" not in err  # the token is never printed


def test_base64_padding_stays_in_the_token_and_a_tokens_file_works(tmp_path: Path) -> None:
    from runtime.settings import Settings

    s = Settings(api_tokens="dG9rZW4==alice, YWJj=bob")  # type: ignore[arg-type]
    assert s.api_tenants() == {"dG9rZW4=": "alice", "YWJj": "bob"}
    path = tmp_path / "tokens"
    path.write_text("# tenants\nZm9vYmFy==carol\n\n  tok-dave=dave  \n")
    assert Settings(api_tokens_file=path).api_tenants() == {
        "Zm9vYmFy=": "carol",
        "tok-dave": "dave",
    }


@pytest.mark.parametrize(
    ("content", "words"),
    [
        ("# nothing\n\n", "names no token"),
        ("a-token=alice\na-token=bob\n", "repeats the token of entry 1"),
        (None, "cannot read"),
    ],
)
def test_a_bad_tokens_file_refuses_to_start_the_api(
    content: str | None,
    words: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    path = tmp_path / "tokens"
    if content is not None:
        path.write_text(content)
    monkeypatch.setenv("EPD_EC_SECRET", SECRET)
    monkeypatch.setenv("EPD_API_TOKENS_FILE", str(path))
    assert main(["api"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("epd: EPD_API_TOKENS_FILE") and words in err, err
    monkeypatch.setenv("EPD_API_TOKENS", "x-token=alice")  # both: one token names one tenant
    path.write_text("x-token=bob\n")
    assert main(["api"]) == 2
    assert "name the same token" in capsys.readouterr().err


def test_a_missing_ec_secret_stops_the_api_at_start_up(monkeypatch: pytest.MonkeyPatch) -> None:
    from frontend.api import create_app
    from runtime.settings import InsecureSettings, Settings

    monkeypatch.delenv("EPD_EC_SECRET", raising=False)
    monkeypatch.delenv("EPD_ALLOW_UNSIGNED", raising=False)
    with pytest.raises(InsecureSettings) as exc:
        main(["api", "--port", str(free_port())])
    assert "refusing to start the API: EPD_EC_SECRET is not set" in str(exc.value)
    # the app itself refuses in its lifespan too (uvicorn --factory, or in-process use)
    app = create_app(Settings())

    async def start() -> None:
        async with app.router.lifespan_context(app):
            raise AssertionError("the API started without a secret")

    with pytest.raises(InsecureSettings):
        asyncio.run(start())


@pytest.mark.parametrize(
    ("variable", "value", "command", "words"),
    [
        ("EPD_STORE_URL", "rediscluster://h:1", ["demo"], "unknown embedding store scheme"),
        ("EPD_STORE_URL", "redis+cluster://h:1,h:x", ["demo"], "'h:x' in"),
        ("EPD_REDIS_URL", "redis+cluster:///", ["worker", "results"], "names no seed node"),
        ("EPD_STORE_URL", "s3://bucket", ["worker", "encode"], "unknown embedding store scheme"),
        ("EPD_REDIS_URL", "localhost:6379", ["topics", "create"], "a Redis URL must start"),
        ("EPD_KAFKA_BOOTSTRAP", "localhost", ["demo"], "is not HOST:PORT"),
        ("EPD_VALIDATION_MODE", "lax", ["demo"], "'strict' or 'vllm'"),
        ("EPD_DEVICE", "gpu", ["verify"], "is not auto, cpu, cuda or cuda:N"),
        ("EPD_BROKER", "rabbitmq", ["up"], "'auto', 'apache' or 'tansu'"),
    ],
)
def test_a_bad_setting_is_one_line_and_exit_2_before_anything_starts(
    variable: str,
    value: str,
    command: list[str],
    words: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv(variable, value)
    monkeypatch.setenv("EPD_STATE_DIR", str(tmp_path))
    assert main(command) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert err.startswith(f"epd: {variable}: ") and words in err, err
    assert not any(tmp_path.iterdir())  # nothing was started (no state, no logs)


async def test_the_api_server_ticks_once_a_second_and_stops_at_once() -> None:
    """uvicorn's server wakes ten times a second to refresh its Date header; ``epd api``'s
    once, with the header as fresh (a second), and a shutdown signal still ends it at once."""
    import contextlib
    import signal
    import time
    from collections.abc import Iterator
    from typing import Any

    import httpx
    import uvicorn

    from epd.commands.api import QuietServer

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    class Server(QuietServer):
        ticks = 0

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            yield  # the test's process keeps its own handlers

        async def on_tick(self, counter: int) -> bool:
            self.ticks += 1
            return await super().on_tick(counter)

    port = free_port()
    server = Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    task = asyncio.create_task(server.serve())
    for _ in range(500):
        if server.started:
            break
        await asyncio.sleep(0.01)
    async with httpx.AsyncClient() as http:
        r = await http.get(f"http://127.0.0.1:{port}/")
    assert r.status_code == 200 and r.headers["date"]
    ticks = server.ticks
    await asyncio.sleep(1.5)
    assert server.ticks - ticks <= 3  # uvicorn's own: 15
    t0 = time.monotonic()
    server.handle_exit(signal.SIGTERM, None)
    await asyncio.wait_for(task, 5)
    assert time.monotonic() - t0 < 0.9  # not the rest of a one-second tick
