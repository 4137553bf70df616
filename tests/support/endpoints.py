"""An in-process LearnerEndpoint on loopback, its control loop in a thread of its own."""

from __future__ import annotations

import threading

from apex.transport import LearnerEndpoint, TransportConfig

FAST = TransportConfig(heartbeat_interval_s=0.05, heartbeat_timeout_s=0.5)
SPEC = {"env": {"id": "CartPole-v1"}, "algo": "apex_dqn"}


def welcome_all(hello, index):
    return {**SPEC, "epsilon": 0.4 ** (1 + index)}


class Learner:
    """A LearnerEndpoint whose control loop runs in a background thread (``endpoint``:
    LearnerEndpoint's keyword arguments, e.g. a learner group's signer and routes)."""

    def __init__(self, port, welcome=welcome_all, options=FAST, **endpoint):
        self.endpoint = LearnerEndpoint("127.0.0.1", port, welcome, options, **endpoint)
        self.calls: list = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        while not self._stop.is_set():
            with self._lock:
                while self.calls:
                    fn = self.calls.pop(0)
                    fn(self.endpoint)
            self.endpoint.poll(10)

    def call(self, fn):
        """Runs fn(endpoint) on the control thread (sockets belong to one thread)."""
        done = threading.Event()
        with self._lock:
            self.calls.append(lambda e: (fn(e), done.set()))
        assert done.wait(5)

    def close(self):
        self._stop.set()
        self._thread.join(5)
        self.endpoint.close()
