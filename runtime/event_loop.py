"""The event loop every process of ours runs on: uvloop where it is installed, else asyncio.

A request costs the coordinator dozens of socket events, callbacks and task switches (Kafka
produce and fetch, Redis commands, HTTP); asyncio's pure-Python selector loop spends more CPU on
them than the work they carry. uvloop runs the same loop on libuv in C. ``EPD_EVENT_LOOP``
(``auto``, ``uvloop``, ``asyncio``) chooses; the test suite's in-process tests run on asyncio,
the processes they start on the setting.
"""

from __future__ import annotations

import asyncio
import importlib.util
from collections.abc import Coroutine
from typing import Any, Literal, TypeVar

T = TypeVar("T")

LoopChoice = Literal["auto", "uvloop", "asyncio"]


def loop_name(choice: LoopChoice) -> Literal["uvloop", "asyncio"]:
    """The loop ``choice`` resolves to here (``auto``: uvloop when it can be imported)."""
    if choice == "auto":
        return "uvloop" if importlib.util.find_spec("uvloop") is not None else "asyncio"
    if choice == "uvloop" and importlib.util.find_spec("uvloop") is None:
        raise RuntimeError("EPD_EVENT_LOOP=uvloop but uvloop is not installed (pip install uvloop)")
    return choice


def run(main: Coroutine[Any, Any, T], choice: LoopChoice = "auto") -> T:
    """``asyncio.run(main)`` on the loop ``choice`` resolves to."""
    if loop_name(choice) == "uvloop":
        import uvloop

        return uvloop.run(main)
    return asyncio.run(main)
