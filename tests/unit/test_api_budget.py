"""The pure logic under the body budget and the fetched-media total (issue 27, defects 4, 5):
the byte budget and its reservations, a request's fetch count, the byte pre-scan that lets
the surrogate check skip the parsed strings, and the one that refuses a text far over its
limit before the parse."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from frontend.api.errors import from_validation
from frontend.api.submit.json_text import _may_hold_surrogate, _tree_problem, refuse_long_text
from frontend.api.submit.media_urls import FetchTotal, MediaRef
from frontend.api.submit.reading import ByteBudget, Reservation
from schemas.errors import ValidationError


def test_a_budget_refuses_what_does_not_fit_and_takes_nothing_then() -> None:
    b = ByteBudget(10)
    assert b.take(6) and b.free == 4
    assert not b.take(5) and b.used == 6  # refused whole, nothing taken
    assert b.take(4) and b.free == 0
    b.give(10)
    assert b.free == 10
    with pytest.raises(ValueError):
        ByteBudget(0)


def test_a_reservation_grows_to_cover_and_goes_back_whole_once() -> None:
    b = ByteBudget(100)
    r = Reservation(b)
    assert r.cover(30) and r.cover(20) and r.held == 30  # never shrinks by covering less
    assert r.cover(80) and b.used == 80
    other = Reservation(b)
    assert not other.cover(30) and other.held == 0 and b.used == 80
    r.release()
    r.release()  # idempotent: nothing is given back twice
    assert b.used == 0
    assert other.cover(30)


def test_a_requests_fetches_share_one_total_and_the_item_that_crosses_it_is_named() -> None:
    total = FetchTotal(100)
    a = MediaRef("messages[0].content[1].image_url.url", 0, "image")
    b = MediaRef("messages[0].content[2].image_url.url", 1, "image")
    total.add(60, a)
    assert total.room() == 40
    with pytest.raises(ValidationError) as e:
        total.add(41, b)
    assert (e.value.rule, e.value.field, e.value.item) == ("image_url.total", b.field, 1)
    assert from_validation(e.value).status == 413


@pytest.mark.parametrize(
    ("text", "may"),
    [
        ('{"a": "x"}', False),
        ('{"a": "\\u00e9 and \\ud7ff"}', False),  # escapes outside the surrogate range
        ('{"a": "\\ud800"}', True),
        ('{"a": "\\uDFFF"}', True),
        ('{"a": "\\ud83d\\ude00"}', True),  # a pair: the parsed-string scan decides (clean)
        ('{"a": "한국어"}', False),  # ED 95 9C: Hangul, not a surrogate
    ],
)
def test_the_byte_prescan_finds_every_way_a_surrogate_can_be_written(text: str, may: bool) -> None:
    assert _may_hold_surrogate(text.encode()) is may


def test_the_prescan_leaves_other_encodings_and_raw_surrogates_to_the_full_scan() -> None:
    raw = '{"a": "\ud800"}'.encode("utf-8", "surrogatepass")  # json.loads takes it
    assert _may_hold_surrogate(raw)
    assert _may_hold_surrogate('{"a": "x"}'.encode("utf-16"))
    assert _may_hold_surrogate('{"a": "x"}')  # already text
    many = ("\\u00e9" * 300).join(['{"a": "', '"}']).encode()
    assert _may_hold_surrogate(many)  # past ESCAPES_SCANNED: scanned in full


CHARS = st.one_of(st.characters(), st.integers(0xD800, 0xDFFF).map(chr))
"""Any character, lone surrogates included (hypothesis leaves them out by default)."""


@given(st.lists(CHARS, max_size=40).map("".join))
def test_when_the_prescan_says_no_the_parsed_strings_hold_no_surrogate(s: str) -> None:
    for ensure_ascii in (True, False):
        body = json.dumps({"k": s, s: [s]}, ensure_ascii=ensure_ascii).encode(
            "utf-8", "surrogatepass"
        )
        obj = json.loads(body)
        if not _may_hold_surrogate(body):
            assert _tree_problem(obj, 32) is None


def _long_text(body: dict[str, Any], keys: tuple[str, ...] = ("prompt",)) -> str | None:
    """The field :func:`refuse_long_text` refuses in ``body`` (limit 1000), else None."""
    try:
        refuse_long_text(json.dumps(body).encode(), keys, 1000)
    except ValidationError as e:
        assert e.rule == "request.prompt" and from_validation(e).status == 413
        return e.field
    return None


def test_a_text_far_over_its_limit_is_refused_from_the_raw_bytes() -> None:
    assert _long_text({"prompt": "x" * 13_000}) == "prompt"
    assert _long_text({"cache_salt": "s", "prompt": "é" * 13_000}) == "prompt"  # escaped: 6 B
    chat = {"messages": [{"role": "user", "content": [{"type": "text", "text": "x" * 13_000}]}]}
    assert _long_text(chat, ("content", "text")) == "text"


@pytest.mark.parametrize(
    "body",
    [
        {"prompt": "x" * 11_000},  # under 12 bytes a character: the parse counts it exactly
        {"prompt": "hi", "images": ["A" * 50_000]},  # media strings are not text
        {"note": 'say "prompt": "' + "x" * 13_000},  # a key's look-alike inside a string
        {"token_ids": list(range(5_000))},  # a long run outside any string
        {"prompt": 'a"b' * 5_000},  # quotes inside: left to the parse
    ],
)
def test_the_prescan_leaves_what_it_cannot_be_sure_of_to_the_parse(body: dict[str, Any]) -> None:
    assert _long_text(body) is None


def test_the_prescan_costs_a_few_finds_not_a_loop_over_the_bytes() -> None:
    many = json.dumps({"images": ["ab"] * 500_000}).encode()  # a quote every few bytes
    refuse_long_text(many, ("prompt",), 1000)  # returns: windows that hold a quote are skipped
    big = b'{"prompt": "' + b"x" * (8 << 20) + b'"}'
    with pytest.raises(ValidationError):
        refuse_long_text(big, ("prompt",), 262_144)
