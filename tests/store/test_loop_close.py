"""Closing a reader's loop: its threads are gone from the OS, not only joined (FORK-AFTER-CLOSE)."""

from __future__ import annotations

import ctypes
import os
import threading

import pytest

from streamdata.store.loop import LoopThread

EXIT_DELAY_US = 300_000  # a thread-exit handler this long: the thread outlives its join by it

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="Linux's /proc/self/task")


def test_a_closed_loops_thread_is_gone_from_the_os_when_close_returns():
    """FORK-AFTER-CLOSE: the loop thread runs a thread-exit handler after ``Thread.join`` has
    returned (as OpenSSL's does; here a thread-local destructor that sleeps); ``close`` returns
    only once the thread has left ``/proc/self/task``, so a worker forked next inherits no lock
    it holds."""
    libc = ctypes.CDLL(None)
    key = ctypes.c_uint()
    assert libc.pthread_key_create(ctypes.byref(key), ctypes.cast(libc.usleep, ctypes.c_void_p)) == 0
    lt = LoopThread("close-test")
    try:
        async def slow_exit() -> int:  # on the loop's thread: its exit calls usleep(EXIT_DELAY_US)
            libc.pthread_setspecific(key, ctypes.c_void_p(EXIT_DELAY_US))
            return threading.get_native_id()

        tid = lt.run(slow_exit(), 10)
        lt.close()
        assert not os.path.exists(f"/proc/self/task/{tid}"), "close returned before the thread was gone"
    finally:
        lt.close()
        libc.pthread_key_delete(key)
