"""glibc malloc tuning: applied once, skipped when the user chose otherwise."""

from __future__ import annotations

import platform

import pytest

from rose.engine import host_malloc


@pytest.fixture
def fresh(monkeypatch):
    monkeypatch.setattr(host_malloc, "_applied", None)
    for key in ("ROSE_MALLOC_TUNING", "GLIBC_TUNABLES", "LD_PRELOAD", *host_malloc._THRESHOLD_ENV):
        monkeypatch.delenv(key, raising=False)
    return monkeypatch


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc only")
def test_applied_once_on_glibc(fresh):
    fresh.setenv("MALLOC_ARENA_MAX", "2")  # a container's usual setting is not a threshold choice
    applied = host_malloc.tune_malloc()
    assert applied == {"mmap_threshold": 32 * 2**20, "trim_threshold": 2**30}
    assert host_malloc.tune_malloc() is applied and host_malloc.malloc_tuning() is applied


@pytest.mark.parametrize(
    "env",
    [
        {"ROSE_MALLOC_TUNING": "0"},
        {"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=1"},
        {"MALLOC_TRIM_THRESHOLD_": "131072"},
        {"LD_PRELOAD": "/usr/lib/libjemalloc.so.2"},
    ],
)
def test_users_own_choice_wins(fresh, env):
    for key, value in env.items():
        fresh.setenv(key, value)
    assert host_malloc.tune_malloc() is None
    assert host_malloc.malloc_tuning() is None
