"""One id order for a request's two streams: its status changes and its tokens.

A reader follows both streams as one feed and names its place in it by the last id it read of
each (the SSE ``Last-Event-ID``). With ``*`` ids from the server's clock, a status change and a
token chunk written in the same millisecond got equal ids, and nothing could tell which was
written first: a live reader and a replay put them in different orders and gave the same event
different ids. Every script that appends to either stream therefore takes its id from
:data:`NEXT_ID_LUA`: the server's clock, or one past the last entry of *both* streams when that
is later, so the ids of the two streams together are in write order, without ties. (On a
cluster both streams carry the request's hash tag, so one script can read them both.) The
readers of either stream take their range starts and sort keys from here too.
"""

from __future__ import annotations

NEXT_ID_LUA = """
local function next_stream_id(first, second)
    local now = redis.call('TIME')
    local ms = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
    local seq = 0
    for _, key in ipairs({first, second}) do
        local last = redis.call('XREVRANGE', key, '+', '-', 'COUNT', 1)[1]
        if last then
            local lms, lseq = string.match(last[1], '^(%d+)-(%d+)$')
            lms, lseq = tonumber(lms), tonumber(lseq)
            if lms > ms or (lms == ms and lseq >= seq) then
                ms, seq = lms, lseq + 1
            end
        end
    end
    return string.format('%.0f-%.0f', ms, seq)
end
"""
"""A Lua function, ``next_stream_id(first, second)``, for a script to define before its body:
the id to XADD to either of two streams so that it follows every entry of both."""


def range_after(entry_id: str) -> str:
    """The XRANGE start that reads a stream's entries after ``entry_id`` (``"0"``: all)."""
    return "-" if entry_id in ("", "0", "0-0") else f"({entry_id}"


def entry_order(entry_id: str) -> tuple[int, int]:
    """A stream entry id (``MS-SEQ``) as the pair it sorts by, across both of a request's
    streams (:data:`NEXT_ID_LUA` makes their ids one order)."""
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)
