"""The key-value store a learner group meets at: only the run's ranks may use it, and it holds
a bounded amount.

torch.distributed's TCPStore takes any client that reaches its port (a process of another
user on a shared node, a sidecar) and keeps every key it is sent. This store speaks
ZeroMQ with CURVE: rank 0 serves it on ``--master``'s address, and its authenticator admits
only the key pair that the run's secret derives, so a client without the secret never
completes the handshake, let alone sets or gets a key; everything on the wire is encrypted.
The secret is the learner's CURVE secret key where the run has keys (``transport.curve_dir``:
every rank serves actors with them, on every host), else a random one that rank 0 writes to
``LOGDIR/.group/secret`` (0600 in a 0700 directory) for the ranks of one host to read.
An admitted rank is held to MAX_KEYS keys, MAX_KEY_CHARS a key, MAX_VALUE_BYTES a value
and MAX_STORE_BYTES in all; a request over them is refused with a message naming the cap.

Ranks on one host and ranks across hosts use the same store; ``torchrun`` (RANK,
WORLD_SIZE, MASTER_*) brings its own, which this module does not replace.
"""

from __future__ import annotations

import datetime
import hashlib
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack
import torch.distributed as dist
import zmq
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils.monitor import recv_monitor_message

from apex.errors import ApexError
from apex.system.files import open_regular, refuse_link

log = logging.getLogger(__name__)

MAX_KEYS = 4096
MAX_KEY_CHARS = 512
MAX_VALUE_BYTES = 1 << 20
MAX_STORE_BYTES = 8 << 20
_REPLY_S = 3.0  # a request unanswered this long: the server is not there yet, or the secret is stale
_SECRET_FILE = Path(".group") / "secret"
HANDSHAKE_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)


def run_secret(learner_secret: bytes | None, logdir: Path, leader: bool, timeout_s: float) -> bytes:
    """The 32 bytes the store's keys derive from (see the module's doc): from the learner's
    CURVE secret key where the run has one, else rank 0 writes a fresh one and the others
    wait for it at most ``timeout_s``."""
    if learner_secret is not None:
        return hashlib.sha256(b"apex learner group store\0" + learner_secret).digest()
    path = logdir / _SECRET_FILE
    if leader:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        refuse_link(path.parent)  # chmod and the file go into the run, not where a link points
        path.parent.chmod(0o700)
        path.unlink(missing_ok=True)  # the last run's: a follower that read it is told apart by its key
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(os.urandom(32))
    deadline = time.monotonic() + timeout_s
    while True:
        found = _read_secret(path)
        if found is not None:
            return found
        if time.monotonic() > deadline:
            raise ApexError(
                f"no group secret at {path} after {timeout_s:.0f} s: ranks on one host share LOGDIR; "
                "ranks across hosts need the run's CURVE keys (transport.curve_dir, `apex keygen`)"
            )
        time.sleep(0.1)


def _read_secret(path: Path) -> bytes | None:
    """The secret rank 0 wrote, once it is whole; None before. A link, FIFO or other
    file planted there, or one that others may read, is refused."""
    try:
        f = open_regular(path, 32)
    except FileNotFoundError:
        return None
    with f:
        info = os.fstat(f.fileno())
        if info.st_uid != os.getuid() or info.st_mode & 0o077:
            mode = info.st_mode & 0o777
            raise ApexError(f"{path} is not this user's alone (mode {mode:o}): remove it and start again")
        data = f.read(32)
    return data if len(data) == 32 else None


def _keypair(secret: bytes) -> tuple[bytes, bytes]:
    """(public, secret) CURVE keys, z85, derived from the run's secret."""
    curve_secret = zmq.utils.z85.encode(hashlib.sha256(b"apex store key\0" + secret).digest())
    return zmq.curve_public(curve_secret), curve_secret


def _endpoint(host: str, port: int) -> str:
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


class StoreServer:
    """Rank 0's side: the keys, on a thread of its own, for the run's key pair alone."""

    def __init__(self, host: str, port: int, secret: bytes) -> None:
        self.context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        public, curve_secret = _keypair(secret)
        self.auth = ThreadAuthenticator(self.context)
        self.auth.start()
        self.auth.configure_curve_callback("*", credentials_provider=_OnlyKey(public))
        self.sock = self.context.socket(zmq.ROUTER)
        self.sock.curve_server = True
        self.sock.curve_publickey, self.sock.curve_secretkey = public, curve_secret
        self.sock.maxmsgsize = MAX_VALUE_BYTES + MAX_KEY_CHARS * 2 + 1024
        self.sock.linger = 0
        try:
            self.sock.bind(_endpoint(host, port))
        except zmq.ZMQError as e:
            self.close()
            raise ApexError(
                f"rank 0 cannot listen on --master {host}:{port} ({e.strerror}): run rank 0 on the host "
                "whose address --master names, on a port no other program uses"
            ) from None
        # Every failed handshake (a wrong server key, a client key not the run's, bytes that
        # are not ZeroMQ) is an event here: ZAP alone would see only the second.
        self.monitor = self.sock.get_monitor_socket(HANDSHAKE_FAILED)
        self.keys: dict[str, bytes] = {}
        self.held_bytes = 0
        self.refused = 0
        self.turned_away = 0
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, name="apex-group-store", daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self.monitor, zmq.POLLIN)
        while not self._stop.is_set():
            ready = dict(poller.poll(100))
            if self.monitor in ready:
                self._count_handshakes()
            if self.sock not in ready:
                continue
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.ZMQError:
                continue
            if len(frames) != 2:
                continue
            try:
                reply = ["ok", self.handle(msgpack.unpackb(frames[1], raw=False))]
            except (ValueError, TypeError, KeyError, msgpack.UnpackException) as e:
                self.refused += 1
                log.warning("learner group store: refused a request (%s); %d refused so far", e, self.refused)
                reply = ["refused", str(e)]
            try:
                self.sock.send_multipart([frames[0], msgpack.packb(reply)], zmq.NOBLOCK)
            except zmq.ZMQError:
                pass

    def _count_handshakes(self) -> None:
        while True:
            try:
                recv_monitor_message(self.monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            self.turned_away += 1
            if self.turned_away & (self.turned_away - 1) == 0:  # 1, 2, 4, 8...: a flood does not flood the log
                log.warning(
                    "learner group store: turned away a client without the run's key; %d so far", self.turned_away
                )

    def handle(self, request: Any) -> Any:
        """One request, [op, key, args...]; ValueError naming the cap or the fault."""
        if not isinstance(request, list) or not request or not isinstance(request[0], str):
            raise ValueError("a request is [op, key, ...]")
        op, args = request[0], request[1:]
        if op == "check":
            (keys,) = args
            return all(self._key(k) in self.keys for k in keys)
        if op == "num_keys":
            return len(self.keys)
        key = self._key(args[0])
        if op == "get":
            return self.keys.get(key)
        if op == "set":
            self._put(key, _value(args[1]))
            return None
        if op == "add":
            amount = args[1]
            if type(amount) is not int or abs(amount) > 2**62:
                raise ValueError("add takes an integer")
            total = int(self.keys.get(key, b"0")) + amount
            self._put(key, str(total).encode())
            return total
        if op == "compare_set":
            expected, desired = _value(args[1]), _value(args[2])
            current = self.keys.get(key)
            if (current is None and expected == b"") or current == expected:
                self._put(key, desired)
                return desired
            return current if current is not None else expected
        if op == "delete":
            value = self.keys.pop(key, None)
            self.held_bytes -= len(value) if value is not None else 0
            return value is not None
        raise ValueError(f"unknown op {op[:32]!r}")

    @staticmethod
    def _key(key: Any) -> str:
        if not isinstance(key, str) or len(key) > MAX_KEY_CHARS:
            raise ValueError(f"a key is a string of at most {MAX_KEY_CHARS} characters")
        return key

    def _put(self, key: str, value: bytes) -> None:
        old = self.keys.get(key)
        grown = len(value) - (len(old) if old is not None else 0)
        if old is None and len(self.keys) >= MAX_KEYS:
            raise ValueError(f"the group store holds its most keys ({MAX_KEYS}, rendezvous.MAX_KEYS)")
        if self.held_bytes + grown > MAX_STORE_BYTES:
            raise ValueError(f"the group store holds its most bytes ({MAX_STORE_BYTES >> 20} MiB)")
        self.keys[key] = value
        self.held_bytes += grown

    @property
    def refusals(self) -> int:
        """Clients turned away at the handshake (without the run's key) and requests refused."""
        return self.turned_away + self.refused

    def close(self) -> None:
        if hasattr(self, "thread"):
            self._stop.set()
            self.thread.join(1.0)
        if hasattr(self, "monitor"):
            self.sock.disable_monitor()
            self.monitor.close(linger=0)
        self.sock.close(linger=0)
        self.auth.stop()
        self.context.term()


def _value(value: Any) -> bytes:
    if not isinstance(value, bytes) or len(value) > MAX_VALUE_BYTES:
        raise ValueError(f"a value is at most {MAX_VALUE_BYTES >> 20} MiB of bytes")
    return value


class _OnlyKey:
    """The authenticator's callback: the run's public key, and no other."""

    def __init__(self, public: bytes) -> None:
        self.public = public

    def callback(self, domain: str, key: bytes) -> bool:
        return key == self.public  # z85, as pyzmq's authenticator passes it


class RunStore(dist.Store):  # type: ignore[misc,name-defined]  # torch's Store: public, not re-exported
    """A rank's client of the group's store (rank 0's too), as torch.distributed asks a store
    to be: ``get`` and ``wait`` block until the keys are there or the timeout passes."""

    def __init__(
        self,
        host: str,
        port: int,
        secret: bytes,
        timeout: datetime.timedelta,
        fresh_secret: Callable[[], bytes] | None = None,
    ) -> None:
        super().__init__()
        self.set_timeout(timeout)
        self._address = _endpoint(host, port)
        self._fresh_secret = fresh_secret  # asked again on no answer: a follower may have read the last run's
        self._secret = secret
        self._lock = threading.Lock()
        self._context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._sock = self._connect()

    def _connect(self) -> zmq.Socket[bytes]:
        sock = self._context.socket(zmq.DEALER)
        sock.curve_publickey, sock.curve_secretkey = _keypair(self._secret)
        sock.curve_serverkey = _keypair(self._secret)[0]
        sock.linger = 0
        sock.connect(self._address)
        return sock

    def _call(self, *request: Any) -> Any:
        deadline = time.monotonic() + self.timeout.total_seconds()
        with self._lock:
            while True:
                self._sock.send(msgpack.packb(list(request)))
                if self._sock.poll(int(_REPLY_S * 1000)):
                    status, value = msgpack.unpackb(self._sock.recv(), raw=False)
                    if status != "ok":
                        raise RuntimeError(f"the learner group's store refused {request[0]}: {value}")
                    return value
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the learner group's store at {self._address} did not answer (timeout)")
                self._sock.close(linger=0)  # not there yet, or a stale secret: start again
                if self._fresh_secret is not None:
                    self._secret = self._fresh_secret()
                self._sock = self._connect()

    def _until(self, present: Any, what: str, timeout: datetime.timedelta | None = None) -> None:
        limit = (timeout or self.timeout).total_seconds()
        deadline, pause = time.monotonic() + limit, 0.001
        while not present():
            if time.monotonic() > deadline:
                raise RuntimeError(f"timed out after {limit:.0f} s waiting for {what} in the learner group's store")
            time.sleep(pause)
            pause = min(pause * 2, 0.05)

    # -- torch.distributed's Store

    def set(self, key: str, value: bytes | str) -> None:
        self._call("set", key, value.encode() if isinstance(value, str) else bytes(value))

    def get(self, key: str) -> bytes:
        found: list[bytes] = []

        def there() -> bool:
            value = self._call("get", key)
            if value is not None:
                found.append(value)
            return value is not None

        self._until(there, key)
        return found[0]

    def add(self, key: str, amount: int) -> int:
        return int(self._call("add", key, int(amount)))

    def check(self, keys: list[str]) -> bool:
        return bool(self._call("check", list(keys)))

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        self._until(lambda: self.check(keys), ", ".join(keys), timeout)

    def compare_set(self, key: str, expected: bytes | str, desired: bytes | str) -> bytes:
        as_bytes = [v.encode() if isinstance(v, str) else bytes(v) for v in (expected, desired)]
        return bytes(self._call("compare_set", key, *as_bytes))

    def delete_key(self, key: str) -> bool:
        return bool(self._call("delete", key))

    def num_keys(self) -> int:
        return int(self._call("num_keys"))

    def close(self) -> None:
        self._sock.close(linger=0)
        self._context.term()
