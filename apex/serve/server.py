"""`apex serve`: an actor whose environments are remote. It joins the learner like any actor
(handshake, weights, heartbeats, reconnects), runs the policy for clients that step their own
simulators, over HTTP/JSON (``apex.serve.http_frontend``) and ZeroMQ/msgpack (``apex.serve.zmq_frontend``), and
sends the n-step chunks or unrolls their episodes make (``apex.serve.episodes``) to the learner.

Two threads: the main one runs the asyncio frontends; the learner thread keeps the
connection (ticks, weights) and sends batches, waiting while the learner is full, so that a
slow learner slows the clients (requests wait) and no data is dropped. A lock serialises the
two around the episodes.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
import resource
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from apex.actor.process import welcome_setup
from apex.config import ServeConfig
from apex.errors import ApexError, ProtocolError
from apex.serve.episodes import RequestError
from apex.serve.welcome import external_episodes, external_teams
from apex.system.logs import RateLimitedLog
from apex.system.signals import StopSignals
from apex.transport import ActorConnection, HandshakeRejected, Stopped, TransportConfig, is_loopback

if TYPE_CHECKING:
    import numpy as np

    from apex.serve.http_frontend import HttpFrontend
    from apex.serve.zmq_frontend import ZmqFrontend

log = logging.getLogger(__name__)

TICK_S = 0.01  # the learner thread's loop: heartbeats, weights, batches
FLUSH_S = 0.2  # data held back for a fuller batch goes to the learner after this long
EXPIRE_EVERY_S = 1.0
MAX_BACKLOG = 16  # batches waiting for the learner before requests that make data wait
BACKLOG_WAIT_S = 30.0  # then such a request is answered 503
BACKLOG_POLL_S = 0.002  # how often such a request looks for room (it holds no thread meanwhile)
STOP_POLL_S = 0.05  # how often the frontends' loop looks for a stop
TOKEN_ENV = "APEX_SERVE_TOKEN"


@dataclass(frozen=True)
class ServeOptions:
    http: tuple[str, int] | None = ("127.0.0.1", 8000)
    zmq: tuple[str, int] | None = None
    token: str | None = None
    max_episodes: int = 1024
    episode_timeout_s: float = 60.0
    curve_dir: str | None = None  # CURVE on the ZeroMQ frontend too (serve.key_secret, serve-clients/)
    limits: ServeConfig = ServeConfig()  # the HTTP frontend's: the local config's serve section
    allow_imports: tuple[str, ...] = ()  # what the learner's config may import here (apex.config.trust)


def read_token(token_file: str | None) -> str | None:
    """The bearer token from ``token_file`` (its first line) or APEX_SERVE_TOKEN; None if neither."""
    if token_file:
        try:
            lines = Path(token_file).read_text().strip().splitlines()
        except (OSError, UnicodeDecodeError) as e:
            raise ApexError(f"--token-file {token_file}: {getattr(e, 'strerror', None) or e}") from None
        token = lines[0].strip() if lines else ""
        if len(token) < 16:
            raise ApexError(
                f"--token-file {token_file}: the token must be at least 16 characters on its first line "
                "(e.g. python -c 'import secrets; print(secrets.token_urlsafe(32))' > FILE)"
            )
        return token
    token = os.environ.get(TOKEN_ENV, "").strip()
    if token and len(token) < 16:
        raise ApexError(f"{TOKEN_ENV} must be at least 16 characters")
    return token or None


def check_exposure(options: ServeOptions) -> None:
    """A server that listens beyond loopback must have a token: anyone who reaches the port
    could otherwise feed the learner."""
    for name, address in (("--http", options.http), ("--zmq", options.zmq)):
        if name == "--zmq" and options.curve_dir:
            continue  # only holders of an authorised client key can connect
        if address is not None and not is_loopback(address[0]) and options.token is None:
            raise ApexError(
                f"{name} {address[0]}:{address[1]} listens beyond this machine: give clients a bearer "
                f"token with --token-file FILE or {TOKEN_ENV} (at least 16 characters)"
                + (", or CURVE keys with --curve-dir DIR" if name == "--zmq" else "")
            )


class Server:
    """The episodes, the learner connection and what both frontends share."""

    def __init__(self, client: ActorConnection, options: ServeOptions) -> None:
        self.client = client
        self.options = options
        if client.welcome is None:
            raise ValueError("serve takes a client that joined the learner (its handshake done)")
        setup = client.welcome.fields["setup"]
        self.config, side = welcome_setup(
            setup, options.allow_imports, f"the welcome of the learner at {client.host}:{client.ports.control}"
        )
        from apex.envs.multi_agent import is_multi_agent  # the env's modules: once the welcome is checked

        limits = (options.max_episodes, options.episode_timeout_s, options.limits.max_episodes_per_client)
        self.episodes = (
            external_teams(self.config, setup, side, *limits)
            if is_multi_agent(self.config.env)
            else external_episodes(self.config, setup, side, *limits)
        )
        self.lock = threading.Lock()
        self.rejected: Counter[str] = Counter()
        self.requests = 0
        self.batches_sent = 0
        # made, not yet sent: (arrays, info, weights version)
        self.backlog: list[tuple[dict[str, np.ndarray], dict[str, Any], int]] = []
        self.stop_reason: str | None = None
        self.error: BaseException | None = None  # the learner thread's, if it failed
        self._bad_log = RateLimitedLog(log, interval_s=5.0)
        self._internal_log = RateLimitedLog(log, interval_s=5.0)
        self._last_data = time.monotonic()

    # -- what the frontends call (main thread)

    def authorised(self, presented: str | None) -> bool:
        token = self.options.token
        # surrogateescape: a header's undecodable bytes (aiohttp keeps them as surrogates) compare, not raise
        return token is None or (
            presented is not None and hmac.compare_digest(presented.encode("utf-8", "surrogateescape"), token.encode())
        )

    def refused(self, error: RequestError | str, reason: str | None = None, peer: str = "?") -> None:
        """Counts (and, rate-limited, logs) a refused request."""
        key = reason or str(getattr(error, "reason", "other"))
        self.rejected[key] += 1
        self._bad_log.warning("refused a request from %s (%s): %s", peer, key, error)

    def internal_error(self) -> RequestError:
        """Counts and logs (rate-limited, with its traceback) an exception that a request
        raised in apex's own code, and returns the 500 error to answer it with: the frontend
        serves on."""
        self.rejected["internal"] += 1
        self._internal_log.exception("a request failed in apex serve itself (answered 500, serving on)")
        return RequestError(500, "internal", "apex serve failed on this request: its log says why")

    async def wait_for_room(self) -> None:
        """Requests that make data wait while the learner is behind (as local actors do)."""
        deadline = time.monotonic() + BACKLOG_WAIT_S
        while len(self.backlog) >= MAX_BACKLOG and self.stop_reason is None:
            if time.monotonic() > deadline:
                raise RequestError(503, "busy", "the learner is not taking data; try again later")
            await asyncio.sleep(BACKLOG_POLL_S)

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """One request's work on the episodes, under the lock; RequestError as it comes."""
        with self.lock:
            self.requests += 1
            result = getattr(self.episodes, method)(*args, **kwargs)
            if method != "start":
                self._collect(flush=False)
            return result

    def health(self) -> dict[str, Any]:
        with self.lock:
            e = self.episodes
            return {
                "status": "stopping" if self.stop_reason else "ok",
                "algo": self.config.algo,
                "env": self.config.env.id,
                "actor_index": self.client.actor_index,
                "connected": self.client.connected,
                "weights_version": e.actor.weights_version,
                "episodes_open": len(e.episodes),
                "episodes_started": e.started,
                "episodes_finished": e.finished,
                "episodes_expired": e.expired,
                "env_steps": e.steps,
                "requests": self.requests,
                "batches_sent": self.batches_sent,
                "rejected_by_reason": dict(self.rejected),
            }

    # -- the learner thread

    def _collect(self, flush: bool) -> None:
        """Moves ready batches from the episodes to the backlog (under the lock)."""
        made = self.episodes.take_batches(flush=flush)
        if made:
            version = self.episodes.actor.weights_version
            self.backlog += [(arrays, info, version) for arrays, info in made]
            self._last_data = time.monotonic()

    def learner_loop(self, stopping: threading.Event) -> None:
        """Ticks, weights, expiry and sends until the learner says stop or ``stopping``."""
        next_expiry = time.monotonic() + EXPIRE_EVERY_S
        bad_weights = RateLimitedLog(log, interval_s=10.0)
        try:
            while self.client.stop_reason is None and not stopping.is_set():
                self.client.tick()
                if (weights := self.client.take_weights()) is not None:
                    with self.lock:
                        try:
                            self.episodes.actor.set_weights(weights)
                        except ProtocolError as e:  # it acts on with the weights it has
                            bad_weights.warning("serve: weights refused: %s", e)
                now = time.monotonic()
                with self.lock:
                    if now >= next_expiry:
                        if expired := self.episodes.expire():
                            log.info(
                                "serve: %d idle episodes expired (%.0f s without a request)",
                                expired,
                                self.options.episode_timeout_s,
                            )
                        next_expiry = now + EXPIRE_EVERY_S
                    self._collect(flush=now - self._last_data > FLUSH_S)
                    batch = self.backlog[0] if self.backlog else None
                if batch is None:
                    time.sleep(TICK_S)
                    continue
                arrays, info, version = batch
                if not self.client.send_batch(arrays, weights_version=version, info=info):
                    break  # a stop arrived while waiting to send
                with self.lock:
                    self.backlog.pop(0)
                    self.batches_sent += 1
        except Stopped:
            pass
        except BaseException as e:  # said by the main thread, which exits with it
            self.error = e
        finally:
            self.stop_reason = self.client.stop_reason or "stopped"


def run_serve(
    host: str,
    port: int,
    options: ServeOptions,
    *,
    actor_index: int | None = None,
    num_envs: int | None = None,
    transport: TransportConfig = TransportConfig(),
) -> int:
    """The `apex serve` process: handshake, then serve until the learner stops or a signal."""
    import apex.envs.make  # noqa: F401  (gymnasium before signals are taken over, as an actor does)

    check_exposure(options)
    raise_open_file_limit()
    if options.http is not None:
        try:
            import aiohttp  # noqa: F401
        except ImportError:
            raise ApexError(
                "apex serve --http needs aiohttp: pip install 'apex-rl[serve]' "
                "(or serve ZeroMQ only: --http off --zmq PORT)"
            ) from None
    stopping = threading.Event()
    with StopSignals(then=stopping.set) as signals:
        return _serve_until_stopped(host, port, options, actor_index, num_envs, transport, stopping, signals)


def raise_open_file_limit() -> None:
    """Raises this process's soft limit on open files to its hard limit (as Go's runtime does):
    every connection costs a file, and at a soft limit of 1024 a few idle ones would keep the
    ZeroMQ frontend, which has no cap on connections of its own, from accepting any more."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError) as e:  # RLIM_INFINITY, say, where the kernel caps it lower
            log.warning("cannot raise the open-file limit from %d to %d: %s", soft, hard, e)


def _serve_until_stopped(
    host: str,
    port: int,
    options: ServeOptions,
    actor_index: int | None,
    num_envs: int | None,
    transport: TransportConfig,
    stopping: threading.Event,
    signals: StopSignals,
) -> int:
    client = ActorConnection(
        host, port, actor_index=actor_index, num_envs=num_envs or 0, options=transport, should_stop=stopping.is_set
    )
    try:
        try:
            client.handshake()
        except Stopped:
            return signals.exit_code()
        except HandshakeRejected:
            if client.stop_reason is None:
                raise
            return 0
        server = Server(client, options)
        learner_thread = threading.Thread(
            target=server.learner_loop, args=(stopping,), name="apex-serve-learner", daemon=True
        )
        learner_thread.start()
        try:
            asyncio.run(_serve(server, stopping))
        finally:
            stopping.set()
            learner_thread.join(timeout=10)
        if server.error is not None:
            raise server.error
        reason = client.stop_reason or (signals.reason() if signals.received else server.stop_reason)
        log.info("serve stopping: %s", reason)
        return signals.exit_code() if client.stop_reason is None else 0
    finally:
        client.close()


async def _serve(server: Server, stopping: threading.Event) -> None:
    # The frontends import server (their Server): imported here, once both modules exist.
    from apex.serve import http_frontend as serve_http
    from apex.serve import zmq_frontend as serve_zmq

    frontends: list[HttpFrontend | ZmqFrontend] = []
    if server.options.http is not None:
        frontends.append(await serve_http.start(server, *server.options.http))
    if server.options.zmq is not None:
        frontends.append(await serve_zmq.start(server, *server.options.zmq))
    where = ", ".join(f.describe() for f in frontends)
    log.info(
        "serving %s on %s (%s, %s) as actor %d of the learner at %s:%d",
        server.config.algo,
        where,
        server.config.env.id,
        server.episodes.describe(),
        server.client.actor_index,
        server.client.host,
        server.client.ports.control,
    )
    try:
        while not stopping.is_set() and server.stop_reason is None:
            await asyncio.sleep(STOP_POLL_S)
    finally:
        for frontend in frontends:
            await frontend.close()
