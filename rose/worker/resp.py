"""Commands sent as pre-packed RESP on a pooled redis-py connection, with their replies read later.

Two hot paths of the worker need what redis-py's client API does not offer: packing a few hundred arguments
cheaply (redis-py wraps hiredis's packer in per-argument Python; called directly it costs half as much, on the cores
the model runs on) and reading a reply after the engine step instead of waiting for it before (`Pending`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import redis

try:
    from hiredis import pack_command as _hiredis_pack
except ImportError:  # redis-py without its hiredis extra
    _hiredis_pack = None


def pack_command_python(items: Sequence[str | int | float | bytes]) -> bytes:
    """`pack_command` in pure Python (what it falls back to without hiredis)."""
    enc = [
        x if isinstance(x, bytes) else x.encode() if isinstance(x, str) else str(x).encode() for x in items
    ]
    return b"*%d\r\n" % len(enc) + b"".join(b"$%d\r\n%b\r\n" % (len(x), x) for x in enc)


def pack_command(items: Sequence[str | int | float | bytes]) -> bytes:
    """RESP encoding of one command: the bytes redis-py's `pack_command` sends, at half its cost (hiredis's packer,
    called directly; a third without hiredis)."""
    if _hiredis_pack is not None:
        try:
            return _hiredis_pack(tuple(items))
        except TypeError:  # a type hiredis does not pack
            pass
    return pack_command_python(items)


def pack_commands(commands: Sequence[Sequence[str | int | float | bytes]]) -> bytes:
    """Several commands packed (`pack_command`) to be sent at once."""
    return b"".join(pack_command(command) for command in commands)


class Pending:
    """Replies still to be read from a pooled connection. The connection goes back to the pool once they are read,
    or closed by `abandon()` (an unread reply must never reach the next command sent on it); `read(keep=True)` holds
    it for more commands (`send`: a WATCH holds only on its own connection)."""

    def __init__(self, connection: redis.Redis, packed: bytes, replies: int) -> None:
        self._pool = connection.connection_pool
        conn = self._pool.get_connection()
        try:
            conn.send_packed_command([packed])
        except BaseException:
            conn.disconnect()
            self._pool.release(conn)
            raise
        self._conn: Any = conn
        self._count = replies
        self._got: list[Any] = []  # replies read so far (by `ready`)
        self._broken: BaseException | None = None  # what broke the connection while `ready` read

    def ready(self) -> bool:
        """Whether every reply is in (or the connection broke: `read` then raises), without waiting: the replies
        there so far are read (a MULTI's first reply comes long before its EXEC's)."""
        if self._conn is None or not self._count:
            raise RuntimeError("these replies were already read or abandoned")
        try:
            self._held()
            while len(self._got) < self._count and self._conn.can_read(timeout=0):
                self._got.append(self._one())
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            self._broken = exc
            return True
        return len(self._got) == self._count

    def read(self, keep: bool = False) -> list[Any]:
        """Every reply in order; an error reply comes back as its ResponseError instance, not raised. `keep`: the
        connection stays held for `send` (else it goes back to the pool)."""
        conn = self._conn
        if conn is None or not self._count:
            raise RuntimeError("these replies were already read or abandoned")
        try:
            if self._broken is not None:
                raise self._broken
            while len(self._got) < self._count:
                self._got.append(self._one())
        except BaseException:
            self.abandon()
            raise
        replies, self._got, self._count = self._got, [], 0
        if not keep:
            self._conn = None
            self._pool.release(conn)
        return replies

    def send(self, packed: bytes, replies: int) -> None:
        """More commands on the connection `read(keep=True)` held, their `replies` to be read as before. Never on
        a new socket: redis-py would connect again unasked, and a WATCH holds only on the connection it was sent
        on."""
        if self._conn is None or self._count:
            raise RuntimeError("the connection is not held, or replies are still unread")
        try:
            self._held()
            self._conn.send_packed_command([packed], check_health=False)
        except BaseException:
            self.abandon()
            raise
        self._count = replies

    def _held(self) -> None:
        """Raise if the connection closed under us: redis-py would open a new one unasked (can_read, send), without
        the replies or the WATCH of this one."""
        if getattr(self._conn, "_sock", True) is None:  # redis-py's socket, None once disconnected
            raise redis.ConnectionError("the connection closed before its replies were read")

    def _one(self) -> Any:
        try:
            return self._conn.read_response()
        except redis.ResponseError as exc:
            return exc

    def abandon(self) -> None:
        if self._conn is not None:
            conn, self._conn = self._conn, None
            conn.disconnect()
            self._pool.release(conn)


def call(connection: redis.Redis, items: list[str | int | bytes]) -> Any:
    """Send one command packed by `pack_command` and return its reply (raising an error reply)."""
    (reply,) = Pending(connection, pack_command(items), 1).read()
    if isinstance(reply, Exception):
        raise reply
    return reply
