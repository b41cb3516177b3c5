"""Fixtures of the Mooncake tests (the ``mooncake`` marker itself is owned by ``tests/conftest.py``).

* ``time_limit`` (autouse): a test that runs past ``TEST_TIME_LIMIT_S`` fails with TimeoutError
  (SIGALRM); one that cannot even be interrupted (stuck in native code) ends the whole pytest
  process 30 s later with every thread's stack on stderr. Peer processes limit themselves too
  (``mooncake_peers.py --max-seconds``), so nothing outlives a dead test run for long.
* ``cleanup``: things to close at the end of a test, in reverse order; peer processes are
  resumed (SIGCONT) and killed.
"""

from __future__ import annotations

import faulthandler
import signal

import pytest

TEST_TIME_LIMIT_S = 100


@pytest.fixture(autouse=True)
def time_limit():
    def expired(signum, frame):
        raise TimeoutError(f"test ran longer than {TEST_TIME_LIMIT_S} s")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(TEST_TIME_LIMIT_S)
    faulthandler.dump_traceback_later(TEST_TIME_LIMIT_S + 30, exit=True)
    try:
        yield
    finally:
        signal.alarm(0)
        faulthandler.cancel_dump_traceback_later()
        signal.signal(signal.SIGALRM, previous)


@pytest.fixture(autouse=True)
def quiet_mooncake(monkeypatch):
    monkeypatch.setenv("MC_LOG_LEVEL", "ERROR")


@pytest.fixture
def cleanup():
    things: list = []
    yield things
    for thing in reversed(things):
        if hasattr(thing, "kill"):
            thing.kill()
        else:
            thing.close()
