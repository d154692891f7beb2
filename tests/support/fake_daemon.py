"""The daemon's end of the worker contract without a daemon: ``FakeDaemon`` is just its ZeroMQ
ROUTER control socket (in the test process), ``start_launch`` runs the tiny GPT
(tests/workers/train_check.py, ``STEPS`` steps of batch ``BATCH``) under the local launcher in a
thread, with the given environment."""

from __future__ import annotations

import threading

import zmq

from protocol.messages import decode
from support import TESTS
from trainer.launch import launch

WORKER = TESTS / "workers" / "train_check.py"
STEPS, BATCH = 12, 12


class FakeDaemon:
    """Just the daemon's control socket."""

    def __init__(self):
        self.sock = zmq.Context.instance().socket(zmq.ROUTER)
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"

    def next_message(self, timeout_s=60.0):
        if not self.sock.poll(timeout_s * 1000):
            raise AssertionError("no message from the workers")
        identity, data = self.sock.recv_multipart()
        return identity, decode(data)

    def close(self):
        self.sock.close(0)


def start_launch(tmp_path, store, env, name, job="local"):
    out = tmp_path / name
    box = {}
    args = ["--out", str(out), "--steps", str(STEPS), "--batch-size", str(BATCH)]
    thread = threading.Thread(target=lambda: box.setdefault("result", launch(
        WORKER, args, stages=2, replicas=1, timeout=240, job=job, env={"VARUNA_STORE": str(store), **env})))
    thread.start()
    return thread, box, out
