"""A new stream as Redis's DUMP format, for RESTORE: the stream created at its size in one command.

Redis gives a stream's first node 4 KB of room at its first entry (`stream-node-max-bytes`) and trims it only once
the node is full, so a finished job's streams (RQ's result, rose's `done` event: one small entry each) would each
keep ~4.7 KB until they expire. Compacting one after its XADD and EXPIRE takes a COPY onto a new key and a RENAME
back: four commands and two allocations of its node. RESTORE of a payload built here creates the stream with its node
allocated at its size and its expiry set: one command, and about three quarters of Redis's time for a job's two
streams (`python benchmarks/bench_command_price.py`: 10.7 against 14.6 µs, the same bytes; benchmarks/README.md,
`rose bench redis`, session 30).

The payload is the oldest stream encoding Redis still loads (`RDB_TYPE_STREAM_LISTPACKS`, RDB version 9: Redis 5.0
and every later version, Valkey too): type 15; one radix-tree node (its master id as 16 big-endian bytes, and its
listpack); the stream's length and last id; no consumer groups; then the RDB version and a CRC-64 (Jones) of it all,
little-endian. The listpack holds what `streamAppendItem` writes: a master entry (count, deleted, the first entry's
fields, a 0), then each entry (flags, id as a difference from the master's, its values, or its fields and values when
they differ from the master's, and how many elements it took). Redis checks the CRC, the node key's length and the
listpack's header (every element too, with `sanitize-dump-payload yes`), so a payload that does not hold together is
refused, never loaded: rose.worker.batch_store asks once whether Redis takes one (`store_commands(probe=True)`, read
by `stored`), and otherwise writes with XADD as before.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import anycrc

RDB_TYPE_STREAM_LISTPACKS = 15
RDB_VERSION = 9  # the version that brought streams: loaded by every version since
_SAMEFIELDS = 2  # an entry's flag: its fields are the master entry's

Fields = Sequence[tuple[bytes, bytes]]


_CRC64 = anycrc.Model("CRC64-REDIS")  # Jones's polynomial, reflected, no final xor


def crc64(data: bytes) -> int:
    """Redis's CRC-64 of `data`: crc64(b"123456789") == 0xE9C6D914C4B8D9CA."""
    return int(_CRC64.calc(data))


_NUMERIC_START = frozenset(b"-0123456789")


def _integer(value: bytes) -> int | None:
    """The integer a listpack stores `value` as (Redis's `lpStringToInt64`: digits, an optional minus, no leading
    zero, 64 bits), None if it stays a string."""
    if not 0 < len(value) <= 20 or value[0] not in _NUMERIC_START:
        return None
    try:
        number = int(value)
    except ValueError:
        return None
    return number if str(number).encode() == value and -(2**63) <= number < 2**63 else None


_SMALL = [bytes((n, 1)) for n in range(128)]  # 0..127: one byte, then its length backwards (1)


def _element(value: bytes | int) -> bytes:
    """One listpack element: its encoding and data, then its length backwards (`lpEncodeBacklen`)."""
    number = value if isinstance(value, int) else _integer(value)
    if number is not None:
        if 0 <= number <= 127:
            return _SMALL[number]
        if -4096 <= number <= 4095:
            body = bytes([0xC0 | ((number >> 8) & 0x1F), number & 0xFF])
        elif -(2**15) <= number < 2**15:
            body = b"\xf1" + struct.pack("<h", number)
        elif -(2**23) <= number < 2**23:
            body = b"\xf2" + (number & 0xFFFFFF).to_bytes(3, "little")
        elif -(2**31) <= number < 2**31:
            body = b"\xf3" + struct.pack("<i", number)
        else:
            body = b"\xf4" + struct.pack("<q", number)
    else:
        data = value if isinstance(value, bytes) else b""
        n = len(data)
        if n < 64:
            return bytes((0x80 | n,)) + data + bytes((n + 1,))  # its length backwards: one byte
        if n < 4096:
            body = bytes([0xE0 | (n >> 8), n & 0xFF]) + data
        else:
            body = b"\xf0" + struct.pack("<I", n) + data
    return body + _backlen(len(body))


def _backlen(n: int) -> bytes:
    """An element's length, read backwards from its last byte: 7 bits a byte, the most significant first, every
    byte but the first flagged (`lpEncodeBacklen`)."""
    if n < 128:
        return bytes((n,))
    groups = [n & 127]
    while n := n >> 7:
        groups.append(n & 127)
    groups.reverse()
    return bytes([groups[0], *(g | 128 for g in groups[1:])])


def _listpack(elements: list[bytes | int]) -> bytes:
    body = b"".join(map(_element, elements))
    count = len(elements) if len(elements) < 65535 else 65535
    return struct.pack("<IH", 6 + len(body) + 1, count) + body + b"\xff"


def _length(n: int) -> bytes:
    """An RDB length (`rdbSaveLen`)."""
    if n < 64:
        return bytes([n])
    if n < 16384:
        return bytes([0x40 | (n >> 8), n & 0xFF])
    if n < 2**32:
        return b"\x80" + struct.pack(">I", n)
    return b"\x81" + struct.pack(">Q", n)


def _string(data: bytes) -> bytes:
    return _length(len(data)) + data


def payload(entries: Sequence[tuple[tuple[int, int], Fields]]) -> bytes:
    """The DUMP payload of a stream holding `entries` ((ms, seq) ids, increasing, each with its (field, value)
    pairs), all in one node, as XADD would have written them."""
    if not entries:
        raise ValueError("a stream payload needs an entry")
    (master_ms, master_seq), master_fields = entries[0]
    names = [name for name, _ in master_fields]
    elements: list[bytes | int] = [len(entries), 0, len(names), *names, 0]
    last = (-1, -1)
    for (ms, seq), fields in entries:
        if (ms, seq) <= last or (ms, seq) <= (0, 0):
            raise ValueError(f"stream ids must increase from 0-1: {ms}-{seq} after {last[0]}-{last[1]}")
        last = (ms, seq)
        same = [name for name, _ in fields] == names
        elements += [_SAMEFIELDS if same else 0, ms - master_ms, seq - master_seq]
        if same:
            elements += [value for _, value in fields]
        else:
            elements += [len(fields), *(x for pair in fields for x in pair)]
        elements.append(len(fields) + 3 if same else 2 * len(fields) + 4)
    node = struct.pack(">QQ", master_ms, master_seq)
    body = (
        bytes([RDB_TYPE_STREAM_LISTPACKS])
        + _length(1)
        + _string(node)
        + _string(_listpack(elements))
        + _length(len(entries))
        + _length(last[0])
        + _length(last[1])
        + _length(0)  # consumer groups
        + struct.pack("<H", RDB_VERSION)
    )
    return body + struct.pack("<Q", crc64(body))
