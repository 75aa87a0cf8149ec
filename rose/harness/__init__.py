"""Harness: helpers that start and drive rose's processes from outside.

`redis_server` runs a throwaway `redis-server` on a free port; `sentinel` a Redis Sentinel deployment (a primary,
a replica, three Sentinels) that tests can fail over; `worker_process` runs a `rose-worker` subprocess
(start it, wait until it has registered with RQ, read its log, stop it) and has `wait_for`, the one polling wait.

Used by the test suite, the benchmarks (`rose bench`) and `rose demo` -- never imported by rose-worker or the
engine at run time (tests/harness/test_harness_boundary.py checks it).
"""
