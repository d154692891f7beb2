"""Ending one of a worker's ZeroMQ contexts so that what it sent last still goes out.

pyzmq never terminates a context at interpreter exit: a worker that ends right after its last
send (a step's statistics, its final checkpoint's report) lost the message whenever its I/O
thread had not run yet, or crashed while that thread still read a zero-copy frame exit had freed.
`terminate` closes what is left open and waits for the closed sockets' queues, each within its
linger. The signals a worker handles in Python (the daemon's rescue, SIGTERM) are held during the
wait and delivered after it: pyzmq ends a wait a signal interrupts, and a handler run inside it
could leave the process in the middle of its close.
"""

from __future__ import annotations

import signal
import threading

import zmq

__all__ = ["terminate"]

_HELD = {signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2, signal.SIGCHLD,
         signal.SIGALRM}


def terminate(ctx: zmq.Context) -> None:
    if threading.current_thread() is not threading.main_thread():   # signals reach the main thread only
        ctx.destroy(linger=0)
        return
    before = signal.pthread_sigmask(signal.SIG_BLOCK, _HELD)
    try:
        ctx.destroy(linger=0)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)
