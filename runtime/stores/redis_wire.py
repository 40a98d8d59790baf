"""A minimal RESP2 client for the Redis store's hot path: big values in and out with few copies.

Why not redis-py for these? Its asyncio connection reads through a ``StreamReader`` in 64 KiB
pieces and joins a command's pieces before writing, so a 1-4 MiB value costs several copies and
dozens of event-loop turns. Here replies are received with ``sock_recv_into`` into one reused
buffer per connection and parsed by ``hiredis.Reader`` (hiredis's public parser: no hand-written
RESP parsing, and no dependence on redis-py's private parser modules), and a command's large
argument is sent from the caller's buffer (a tensor's memory) without being joined.

One exception, for GET: ``Reader.feed`` copies into hiredis's own buffer, which grows to the
whole value, and ``gets()`` copies again into ``bytes``, so a big value would cost two memcpys and
twice its size in memory. :meth:`WireConnection.bulk_reply` therefore reads a bulk-string header
(``$<len>\r\n``) itself and, for a value of at least ``_DIRECT_MIN`` bytes, receives the payload
straight into a ``bytearray`` of the value's size, which is what ``get`` returns (the bytes of
the first receive are copied once, at most one receive buffer). Every other reply (errors, nil,
short values, other types) still goes through hiredis.
``bench/stores.py`` puts this path beside redis-py + hiredis and ``redis-benchmark``.

Scope: plain TCP (``redis://``; TLS stays on redis-py), RESP2 replies, AUTH and SELECT on
connect. Error replies become redis-py's public exception classes (:func:`reply_error`, the
same prefixes redis-py maps), so callers see the same errors either way. A connection that fails
or is cancelled mid-command is closed, never reused (its reply stream could be out of step); a
command that fails on a *reused* idle connection with a connection error is retried once on a
fresh one (the server may have closed an idle connection) — every command sent here is
idempotent.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import weakref
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar, cast

import hiredis
from redis import exceptions as rexc
from redis.exceptions import AuthenticationWrongNumberOfArgsError, RedisError, ResponseError
from redis.exceptions import ConnectionError as RedisConnectionError

T = TypeVar("T")
Buffer = bytes | bytearray | memoryview
Reply = bytes | bytearray | int | list[Any] | RedisError | None

_CRLF = b"\r\n"
_RECV_CHUNK = 1 << 18
"""Receive buffer per connection: big enough that a 4 MiB value takes ~16 event-loop turns."""
_DIRECT_MIN = 1 << 16
"""Bulk replies this long or longer skip hiredis (see the module docstring); shorter ones cost
little to copy twice and keep to the one parser."""
_HEADER_MAX = 16
"""Longest bulk header taken here: ``$``, 13 digits, CRLF (values under 10 TB); a longer one goes
to hiredis, which rejects what cannot be a length."""
_MAX_IDLE = 16  # idle connections kept per pool; more concurrent callers open extra ones
MAX_CONNECTIONS = 50
"""Connections a pool holds at once per event loop by default (redis-py's blocking pool's
default, which the store's redis-py path uses): beyond them a command waits for one."""
POOL_WAIT_S = 30.0
"""Longest a command waits for a free connection before the pool's ``ConnectionError``."""


_ERROR_PREFIXES: dict[str, type[RedisError]] = {
    "WRONGPASS": rexc.AuthenticationError,
    "NOAUTH": rexc.AuthenticationError,
    "NOPERM": rexc.NoPermissionError,
    "EXECABORT": rexc.ExecAbortError,
    "LOADING": rexc.BusyLoadingError,
    "MASTERDOWN": rexc.MasterDownError,
    "READONLY": rexc.ReadOnlyError,
    "OOM": rexc.OutOfMemoryError,
    "NOSCRIPT": rexc.NoScriptError,
}
"""Error-reply codes -> redis-py's classes (its own table, for the commands sent here)."""
_ERR_MESSAGES: dict[str, type[RedisError]] = {
    "max number of clients reached": rexc.ConnectionError,
    "invalid password": rexc.AuthenticationError,
    "Client sent AUTH, but no password is set": rexc.AuthenticationError,
    "AUTH <password> called without any password configured for the default user. Are you "
    "sure your configuration is correct?": rexc.AuthenticationError,
    "wrong number of arguments for 'auth' command": AuthenticationWrongNumberOfArgsError,
    "wrong number of arguments for 'AUTH' command": AuthenticationWrongNumberOfArgsError,
}
"""``ERR`` replies redis-py raises as a class of their own (matched on the whole message)."""


def reply_error(message: str) -> RedisError:
    """The redis-py exception for an error reply, e.g. ``WRONGPASS ...`` ->
    ``AuthenticationError`` (so a bad password is a connection problem on both I/O paths);
    anything unlisted is a ``ResponseError`` carrying the message."""
    code, _, rest = message.partition(" ")
    if code == "ERR":  # redis-py drops the code of the codes it knows, ERR included
        return _ERR_MESSAGES.get(rest, ResponseError)(rest)
    cls = _ERROR_PREFIXES.get(code)
    return cls(rest) if cls is not None else ResponseError(message)


def _pack(*args: bytes) -> bytes:
    """One RESP command from small arguments."""
    out = [b"*%d\r\n" % len(args)]
    for a in args:
        out.append(b"$%d\r\n%s\r\n" % (len(a), a))
    return b"".join(out)


class WireConnection:
    """One TCP connection speaking RESP2, bound to the event loop that opened it."""

    def __init__(self, sock: socket.socket, loop: asyncio.AbstractEventLoop) -> None:
        self.sock = sock
        self.loop = loop
        # hiredis parses; a malformed stream raises RedisConnectionError, which closes this
        # connection (pool.run) rather than leaving it out of step.
        self._reader = hiredis.Reader(
            replyError=reply_error, protocolError=RedisConnectionError, notEnoughData=False
        )
        self._rbuf = bytearray(_RECV_CHUNK)  # reused: a receive allocates nothing
        self.closed = False

    async def send(self, *pieces: Buffer) -> None:
        """Write ``pieces`` in order with one gathering ``sendmsg`` where the socket takes it all
        (each send on loopback costs a wake-up of the server), from the callers' memory."""
        bufs = [memoryview(p).cast("B") for p in pieces if len(p)]
        while bufs:
            try:
                sent = self.sock.sendmsg(bufs)
            except (BlockingIOError, InterruptedError):
                sent = 0
            while bufs and sent >= len(bufs[0]):
                sent -= len(bufs.pop(0))
            if bufs:
                bufs[0] = bufs[0][sent:]
                await self._writable()

    async def _writable(self) -> None:
        fut = self.loop.create_future()
        fd = self.sock.fileno()
        self.loop.add_writer(fd, _resolve, fut)
        try:
            await fut
        finally:
            self.loop.remove_writer(fd)

    async def reply(self) -> Reply:
        """The next reply, parsed by hiredis. Error replies are *returned* (as redis-py's
        exception objects) so a caller reading several replies can drain them all before
        raising."""
        reader = self._reader
        while (out := reader.gets()) is False:
            got = await self._recv_into(self._rbuf)
            # feed() takes any buffer (its stub says str | bytes): no copy of the receive buffer
            reader.feed(self._rbuf, 0, got)  # type: ignore[arg-type]
        return cast(Reply, out)

    async def _recv_into(self, buf: bytearray | memoryview) -> int:
        got = await self.loop.sock_recv_into(self.sock, buf)
        if not got:
            raise RedisConnectionError("connection closed by the Redis server")
        return got

    async def bulk_reply(self) -> Reply:
        """The next reply, expected to be one bulk string (GET's). A value of ``_DIRECT_MIN``
        bytes or more is received straight into a ``bytearray`` of its own; anything else goes
        to :meth:`reply` (hiredis) with the bytes received so far."""
        if self._reader.has_data():  # bytes of this reply were already fed: hiredis's turn
            return await self.reply()
        rbuf = memoryview(self._rbuf)
        got = await self._recv_into(rbuf)
        end = -1
        while self._rbuf[0] == 0x24:  # b"$": the header may come in pieces; wait for its CRLF
            end = self._rbuf.find(_CRLF, 0, got)
            if end >= 0 or got >= _HEADER_MAX:
                break
            got += await self._recv_into(rbuf[got:])
        digits = bytes(rbuf[1:end]) if 0 < end < _HEADER_MAX else b""
        if not digits.isdigit() or int(digits) < _DIRECT_MIN:  # nil ($-1), error, short, other
            self._reader.feed(self._rbuf, 0, got)  # type: ignore[arg-type]  # see reply()
            return await self.reply()
        size, start = int(digits), end + 2
        early = min(got - start, size)  # payload bytes that came with the header
        out = bytearray(size)
        with memoryview(out) as view:
            view[:early] = rbuf[start : start + early]
            pos = early
            while pos < size:
                pos += await self._recv_into(view[pos:])
        # The CRLF after the payload: maybe already received, maybe still to come.
        tail = bytes(rbuf[start + early : got])
        while len(tail) < 2:
            n = await self._recv_into(rbuf)
            tail += rbuf[:n]
        if tail[:2] != _CRLF:
            raise RedisConnectionError("malformed bulk reply from the Redis server")
        if len(tail) > 2:  # a following reply (none is expected after GET): hiredis keeps it
            self._reader.feed(tail[2:])
        return out

    async def replies(self, n: int) -> list[Reply]:
        """``n`` replies; raises the first error reply (nested ones too) after reading all."""
        out = [await self.reply() for _ in range(n)]
        for r in out:
            err = _first_error(r)
            if err is not None:
                raise err
        return out

    def close(self) -> None:
        """Close the socket (idempotent)."""
        if not self.closed:
            self.closed = True
            with contextlib.suppress(OSError):
                self.sock.close()


def _resolve(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


def _first_error(reply: Reply) -> RedisError | None:
    if isinstance(reply, RedisError):
        return reply
    if isinstance(reply, list):
        for r in reply:
            err = _first_error(r)
            if err is not None:
                return err
    return None


class WirePool:
    """Idle :class:`WireConnection` s to one server/DB, opened on demand."""

    def __init__(
        self,
        host: str,
        port: int,
        db: int = 0,
        *,
        username: str | None = None,
        password: str | None = None,
        connect_timeout_s: float | None = 5.0,
        timeout_s: float | None = None,
        max_connections: int = MAX_CONNECTIONS,
        pool_wait_s: float = POOL_WAIT_S,
    ) -> None:
        """``max_connections``: commands in flight at once on one event loop (each holds a
        connection); more wait up to ``pool_wait_s`` for one, as redis-py's blocking pool
        waits, so a burst cannot open connections without bound (Redis's ``maxclients``)."""
        if max_connections < 1:
            raise ValueError(f"max_connections must be at least 1, got {max_connections}")
        self.host, self.port, self.db = host, port, db
        self._username, self._password = username, password
        self._connect_timeout_s = connect_timeout_s
        self._timeout_s = timeout_s
        self.max_connections = max_connections
        self._pool_wait_s = pool_wait_s
        # One bound per event loop: an asyncio.Semaphore belongs to the loop that first waits on
        # it, and a pool may serve several loops one after another (connections too are per loop).
        self._slots: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Semaphore] = (
            weakref.WeakKeyDictionary()
        )
        self._idle: list[WireConnection] = []
        self.opened = 0
        """Connections opened so far (tests use it to see reuse)."""

    async def _open(self) -> WireConnection:
        loop = asyncio.get_running_loop()
        infos = await loop.getaddrinfo(self.host, self.port, type=socket.SOCK_STREAM)
        last: Exception = OSError(f"no address for {self.host}:{self.port}")
        for family, kind, proto, _name, addr in infos:
            sock = socket.socket(family, kind, proto)
            sock.setblocking(False)
            try:
                if family in (socket.AF_INET, socket.AF_INET6):
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                async with asyncio.timeout(self._connect_timeout_s):
                    await loop.sock_connect(sock, addr)
            except (OSError, TimeoutError) as exc:
                sock.close()
                last = exc
                continue
            conn = WireConnection(sock, loop)
            try:
                await self._handshake(conn)
            except BaseException:
                conn.close()
                raise
            self.opened += 1
            return conn
        raise last

    async def _handshake(self, conn: WireConnection) -> None:
        # Like redis-py: AUTH as "default" when only a password is given (Redis >= 6 accepts any
        # password for a "nopass" default user that way), the one-argument form for older servers.
        if self._password is not None:
            password = self._password.encode()
            await conn.send(_pack(b"AUTH", (self._username or "default").encode(), password))
            try:
                await conn.replies(1)
            except AuthenticationWrongNumberOfArgsError:
                if self._username:
                    raise
                await conn.send(_pack(b"AUTH", password))
                await conn.replies(1)
        if self.db:
            await conn.send(_pack(b"SELECT", str(self.db).encode()))
            await conn.replies(1)

    async def run(self, op: Callable[[WireConnection], Awaitable[T]]) -> T:
        """Run ``op`` on a connection of this loop, once one of :attr:`max_connections` is
        free; see the module docstring for failures."""
        loop = asyncio.get_running_loop()
        slots = self._slots.get(loop)
        if slots is None:
            slots = self._slots[loop] = asyncio.Semaphore(self.max_connections)
        if slots.locked():
            try:
                async with asyncio.timeout(self._pool_wait_s):
                    await slots.acquire()
            except TimeoutError:
                raise RedisConnectionError(
                    f"no free connection to {self.host}:{self.port} within "
                    f"{self._pool_wait_s:g} s ({self.max_connections} in use)"
                ) from None
        else:
            await slots.acquire()
        try:
            return await self._run(loop, op)
        finally:
            slots.release()

    async def _run(
        self, loop: asyncio.AbstractEventLoop, op: Callable[[WireConnection], Awaitable[T]]
    ) -> T:
        for attempt in (0, 1):
            conn = self._take(loop)
            reused = conn is not None
            if conn is None:
                conn = await self._open()
            try:
                if self._timeout_s is None:
                    result = await op(conn)
                else:
                    async with asyncio.timeout(self._timeout_s):
                        result = await op(conn)
            except (OSError, RedisConnectionError):
                conn.close()
                if reused and attempt == 0:
                    # An idle connection found dead (a Redis restart) says the others, opened to
                    # the same server, are dead too: drop them all, so the retry (and the next
                    # commands) run on a fresh connection rather than the next dead one.
                    self.close()
                    continue
                raise
            except ResponseError:
                self._give(conn)  # raised after every reply was read: still in step
                raise
            except BaseException:
                conn.close()  # cancelled or failed mid-command: the reply stream is suspect
                raise
            self._give(conn)
            return result
        raise AssertionError("unreachable")

    def _take(self, loop: asyncio.AbstractEventLoop) -> WireConnection | None:
        while self._idle:
            conn = self._idle.pop()
            if conn.loop is loop and not loop.is_closed():
                return conn
            conn.close()  # opened on another (maybe finished) event loop
        return None

    def _give(self, conn: WireConnection) -> None:
        if len(self._idle) < _MAX_IDLE:
            self._idle.append(conn)
        else:
            conn.close()

    def close(self) -> None:
        """Close every idle connection."""
        while self._idle:
            self._idle.pop().close()


# --- the commands the store sends ------------------------------------------------------------


async def set_and_publish(
    pool: WirePool,
    key: bytes,
    pieces: Sequence[Buffer],
    px: int | None,
    channel: bytes,
    publish: bytes = b"PUBLISH",
) -> None:
    """``MULTI; SET key <value> [PX px]; PUBLISH channel key; EXEC`` in one write, where the
    value is ``pieces`` back to back, sent from their own buffers (never concatenated).
    ``publish``: ``SPUBLISH`` on a cluster (the channel in the key's slot).

    MULTI/EXEC keeps put-and-notify all or nothing: a connection lost part-way through the write
    leaves neither the value nor the notification (a plain pipeline could leave the value
    without waking waiters). It measured within noise of the plain pipeline for 1-4 MiB."""
    total = sum(len(p) for p in pieces)
    nargs = 3 if px is None else 5
    head = b"%s*%d\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (
        _pack(b"MULTI"),
        nargs,
        len(key),
        key,
        total,
    )
    tail = [_CRLF]
    if px is not None:
        tail.append(b"$2\r\nPX\r\n")
        pxs = str(px).encode()
        tail.append(b"$%d\r\n%s\r\n" % (len(pxs), pxs))
    tail.append(_pack(publish, channel, key))
    tail.append(_pack(b"EXEC"))
    msgs: list[Buffer] = [head, *pieces, b"".join(tail)]  # gathered by one sendmsg

    async def op(conn: WireConnection) -> None:
        await conn.send(*msgs)
        *_, executed = await conn.replies(4)  # +OK, +QUEUED, +QUEUED, [SET, PUBLISH]
        if executed is None:
            raise ResponseError("EXEC aborted the put")

    await pool.run(op)


async def get(pool: WirePool, key: bytes) -> bytes | bytearray | None:
    """``GET key``: the value in a buffer of its own (a ``bytearray`` received in place when
    ``_DIRECT_MIN`` bytes or longer, else ``bytes``), or None."""

    async def op(conn: WireConnection) -> bytes | bytearray | None:
        await conn.send(_pack(b"GET", key))
        value = await conn.bulk_reply()
        if isinstance(value, RedisError):
            raise value
        assert value is None or isinstance(value, bytes | bytearray)
        return value

    return await pool.run(op)


async def mget(pool: WirePool, keys: Sequence[bytes]) -> list[bytes | None]:
    """``MGET keys...``: values in order, None for missing ones."""

    async def op(conn: WireConnection) -> list[bytes | None]:
        await conn.send(_pack(b"MGET", *keys))
        (values,) = await conn.replies(1)
        assert isinstance(values, list)
        return values

    return await pool.run(op)


async def exists_each(pool: WirePool, keys: Sequence[bytes]) -> list[bool]:
    """One pipelined ``EXISTS`` per key: which keys are present."""

    async def op(conn: WireConnection) -> list[bool]:
        await conn.send(b"".join(_pack(b"EXISTS", k) for k in keys))
        return [bool(n) for n in await conn.replies(len(keys))]

    return await pool.run(op)


async def touch(pool: WirePool, key: bytes, px: int | None) -> bool:
    """``PEXPIRE key px`` (``PERSIST key; EXISTS key`` for no expiry): whether the key exists.

    Neither command creates the key, so touching an absent or expired key leaves it absent."""
    if px is None:
        msg, n = _pack(b"PERSIST", key) + _pack(b"EXISTS", key), 2
    else:
        msg, n = _pack(b"PEXPIRE", key, str(px).encode()), 1

    async def op(conn: WireConnection) -> bool:
        await conn.send(msg)
        *_, present = await conn.replies(n)
        return bool(present)

    return await pool.run(op)


async def delete(pool: WirePool, key: bytes) -> None:
    """``DEL key``."""

    async def op(conn: WireConnection) -> None:
        await conn.send(_pack(b"DEL", key))
        await conn.replies(1)

    await pool.run(op)
