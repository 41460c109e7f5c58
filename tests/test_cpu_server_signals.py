"""``exit_on_signals`` and ``signals_deferred`` (sgl_agentcache/cpu_server.py), with real signals sent to
this process: a signal that lands while a deferred block runs (``CpuServer.start`` around ``Popen``) is
raised when the block ends, never inside it, so a started server is always held by someone who stops it.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from sgl_agentcache.cpu_server import Terminated, exit_on_signals, signals_deferred


def _signal_self(signum: int) -> None:
    os.kill(os.getpid(), signum)
    time.sleep(0.05)  # the handler runs at the next bytecode boundary of the main thread


def test_a_signal_inside_a_deferred_block_is_raised_when_the_block_ends():
    steps = []
    with pytest.raises(Terminated) as caught:
        with exit_on_signals(announce=lambda signum: steps.append(("announced", signum))):
            with signals_deferred():
                _signal_self(signal.SIGTERM)
                steps.append("rest of the block ran")
            steps.append("after the block")  # never reached: Terminated is raised as the block ends
    assert steps == [("announced", signal.SIGTERM), "rest of the block ran"]
    assert caught.value.code == 128 + signal.SIGTERM


def test_nested_deferred_blocks_raise_at_the_outermost_end_only():
    steps = []
    with pytest.raises(Terminated):
        with exit_on_signals():
            with signals_deferred():
                with signals_deferred():
                    _signal_self(signal.SIGHUP)
                steps.append("inner block ended quietly")
            steps.append("not reached")
    assert steps == ["inner block ended quietly"]


def test_outside_a_deferred_block_a_signal_raises_at_once_and_no_signal_raises_nothing():
    with exit_on_signals():
        with signals_deferred():
            pass  # nothing held back: nothing raised
        with pytest.raises(Terminated) as caught:
            _signal_self(signal.SIGINT)
    assert caught.value.code == 128 + signal.SIGINT


def test_a_deferred_block_in_another_thread_holds_nothing_back():
    """Signal handlers run in the main thread: a worker thread's block (a benchmark starting servers side
    by side) must not swallow the main thread's Terminated and raise it in the worker instead."""
    import threading

    from sgl_agentcache import cpu_server

    seen = []

    def worker():
        with signals_deferred():
            seen.append(cpu_server._DEFERRED)

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    assert seen == [None]
