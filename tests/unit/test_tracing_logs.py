"""Trace context and JSON log lines (pure: no services)."""

from __future__ import annotations

import json
import logging

from runtime.logs import JsonFormatter
from runtime.tracing import (
    carrier_of,
    current_carrier,
    current_trace_id,
    new_traceparent,
    stage_span,
    trace_id_of,
)

TP = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def test_trace_ids_are_parsed_strictly() -> None:
    assert trace_id_of(TP) == "0af7651916cd43dd8448eb211c80319c"
    for bad in (None, "", "garbage", "00-xyz-b7ad6b7169203331-01", f"00-{'0' * 32}-{'1' * 16}-01"):
        assert trace_id_of(bad) is None
    assert trace_id_of(new_traceparent()) is not None


def test_stage_span_carries_the_context_and_the_request_id() -> None:
    assert current_trace_id() is None and current_carrier() == {}
    with stage_span("encode", {"traceparent": TP}, request_id="r-1"):
        assert current_trace_id() == "0af7651916cd43dd8448eb211c80319c"
        assert trace_id_of(current_carrier()["traceparent"]) == current_trace_id()
        record = logging.LogRecord("epd", logging.INFO, __file__, 1, "hello %s", ("x",), None)
        line = json.loads(JsonFormatter().format(record))
    assert line["msg"] == "hello x" and line["request_id"] == "r-1"
    assert line["trace_id"] == "0af7651916cd43dd8448eb211c80319c"
    assert current_trace_id() is None  # detached afterwards
    outside = json.loads(JsonFormatter().format(record))
    assert "request_id" not in outside and "trace_id" not in outside


def test_the_broker_hop_is_timed_from_the_consumed_records_timestamp() -> None:
    from runtime.tracing import broker_hop_ms

    assert broker_hop_ms(5_000) is None  # not handling a consumed record
    with stage_span("prefill", {}, request_id="r-1", produced_ms=4_750):
        assert broker_hop_ms(5_000) == 250.0
        assert broker_hop_ms(4_700) == 0.0  # clocks a little apart never give a negative hop
        with stage_span("inner", {}, request_id="r-2", produced_ms=-1):
            assert broker_hop_ms(5_000) is None  # a record without a timestamp
        assert broker_hop_ms(5_000) == 250.0
    assert broker_hop_ms(5_000) is None


def test_carrier_prefers_the_event_trace_map_over_the_header() -> None:
    other = new_traceparent()
    assert carrier_of({"traceparent": TP}, {"traceparent": other.encode()}) == {"traceparent": TP}
    assert carrier_of(None, {"traceparent": other.encode()}) == {"traceparent": other}
    assert carrier_of({}, {}) == {}
