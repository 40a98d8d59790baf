"""``epd api``, ``epd submit``, ``epd status``, ``epd cancel``: registered, with help that
explains each; an unreachable API is exit 2 with a message, not a traceback."""

from __future__ import annotations

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
