"""rose.worker.stream_dump: a stream built as Redis's DUMP format is the stream XADD makes, byte for byte once
stored at its size (XADD, then COPY), and Redis takes it with its deep checks on."""

from __future__ import annotations

import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rose.worker import stream_dump

pytestmark = pytest.mark.timeout(120)

MS = 1_796_001_267_333  # a 2026 instant: an id past 32 bits


def restored_and_added(r, entries) -> tuple[bytes, bytes]:
    """DUMP of the stream RESTOREd from `entries`' payload, and of the same entries XADDed, then COPYd."""
    r.delete("restored", "added", "added:copied")
    assert r.restore("restored", 0, stream_dump.payload(entries))
    for (ms, seq), fields in entries:
        r.xadd("added", dict(fields), id=f"{ms}-{seq}")
    r.copy("added", "added:copied")
    return r.dump("restored"), r.dump("added:copied")


def test_crc64_is_redis_s():
    assert stream_dump.crc64(b"123456789") == 0xE9C6D914C4B8D9CA


@pytest.mark.parametrize(
    "fields",
    [
        [(b"event", b'{"type":"done","seq":0,"finish_reason":"length"}')],
        [(b"type", b"1"), (b"worker_name", b"w-1"), (b"return_value", b"eyJ0ZXh0Ijoi" * 40)],  # RQ's result
        # every integer width a listpack has, and strings that only look like integers
        [
            (str(i).encode(), v)
            for i, v in enumerate(
                [
                    b"0",
                    b"127",
                    b"128",
                    b"-1",
                    b"-4096",
                    b"4095",
                    b"4096",
                    b"-32768",
                    b"32767",
                    b"8388607",
                    b"-8388609",
                    b"2147483648",
                    b"-9223372036854775808",
                    b"9223372036854775807",
                    b"9223372036854775808",
                    b"01",
                    b"+1",
                    b"-0",
                    b" 1",
                    b"",
                ]
            )
        ],
        [
            (b"long", b"x" * 63),
            (b"longer", b"y" * 64),
            (b"longest", b"z" * 5000),
        ],  # each string length's encoding
        [
            (b"return_value", b"r" * 20000)
        ],  # an element past 16,383 bytes: its length backwards in three bytes
        [(b"return_value", b"r" * 2_100_000)],  # and past 2,097,151: in four
    ],
)
def test_a_restored_stream_is_the_stream_xadd_makes_stored_at_its_size(r, fields):
    restored, added = restored_and_added(r, [((MS, 0), fields)])
    assert restored == added
    assert r.xrange("restored") == r.xrange("added")
    assert r.memory_usage("restored", samples=0) == r.memory_usage("added:copied", samples=0)


def test_entries_with_the_master_s_fields_or_their_own(r):
    entries = [
        ((MS, 0), [(b"event", b"a")]),
        ((MS, 1), [(b"event", b"b")]),  # the master entry's fields: values only
        ((MS + 5, 0), [(b"other", b"c"), (b"n", b"7")]),  # fields of its own
        ((MS + 5, 300), [(b"event", b"d")]),
    ]
    restored, added = restored_and_added(r, entries)
    assert restored == added
    assert r.xinfo_stream("restored") == r.xinfo_stream("added:copied")


def test_redis_takes_it_with_deep_checks_on(new_redis_server):
    r = new_redis_server.client()
    r.config_set("sanitize-dump-payload", "yes")
    payload = stream_dump.payload([((MS, 0), [(b"type", b"1"), (b"return_value", b"x" * 300)])])
    assert r.restore("k", 0, payload)
    assert r.xlen("k") == 1
    r.close()


def test_a_damaged_payload_is_refused_never_loaded(r):
    payload = bytearray(stream_dump.payload([((MS, 0), [(b"event", b"x")])]))
    payload[20] ^= 1
    with pytest.raises(redis.ResponseError, match="payload"):
        r.restore("k", 0, bytes(payload))
    assert not r.exists("k")


def test_ids_must_increase_from_0_1():
    with pytest.raises(ValueError):
        stream_dump.payload([])
    with pytest.raises(ValueError):
        stream_dump.payload([((0, 0), [(b"f", b"v")])])
    with pytest.raises(ValueError):
        stream_dump.payload([((5, 1), [(b"f", b"v")]), ((5, 1), [(b"f", b"v")])])


values = st.one_of(st.binary(max_size=300), st.integers(-(2**63), 2**63 - 1).map(lambda i: str(i).encode()))
entry_fields = st.lists(st.tuples(st.binary(min_size=1, max_size=20), values), min_size=1, max_size=5).map(
    lambda pairs: list(dict(pairs).items())  # XADD's fields, once each
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(entry_fields, min_size=1, max_size=6), st.lists(st.integers(0, 3), min_size=6, max_size=6))
def test_any_entries_restore_as_xadd_writes_them(r, entries, gaps):
    ids, ms, seq = [], MS, 0
    for gap in gaps[: len(entries)]:
        ms, seq = (ms + gap, 0) if gap else (ms, seq + 1)
        ids.append((ms, seq))
    restored, added = restored_and_added(r, list(zip(ids, entries, strict=False)))
    assert restored == added
