"""CURVE keys: `apex keygen`'s key pairs and their loading, with errors that say what to do."""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import zmq
import zmq.auth

from apex.errors import ApexError

KEY_PAIRS = ("learner", "actor", "serve", "client")


def generate_keys(directory: str | os.PathLike[str]) -> dict[str, Path]:
    """Writes the key pairs of the learner and its actors, and of `apex serve`'s ZeroMQ
    frontend and its clients, and authorises the actor's and the client's public keys.

    Layout: learner.key / learner.key_secret, actor.key / actor.key_secret, authorized/actor.key;
    serve.key / serve.key_secret, client.key / client.key_secret, serve-clients/client.key.
    Actor hosts need actor.key_secret and learner.key; `apex serve` hosts those two and
    serve.key_secret with serve-clients/; client hosts client.key_secret and serve.key.
    """
    directory = Path(directory)
    authorized = directory / "authorized"
    clients = directory / "serve-clients"
    for name in KEY_PAIRS:
        if (directory / f"{name}.key_secret").exists():
            raise ApexError(f"{directory / (name + '.key_secret')} exists: choose an empty directory")
    # Created under umask 077: a secret key is never readable by others, not even for a moment.
    with _umask(0o077):
        authorized.mkdir(parents=True, exist_ok=True)
        clients.mkdir(parents=True, exist_ok=True)
        for name in KEY_PAIRS:
            zmq.auth.create_certificates(str(directory), name)
        shutil.copy(directory / "actor.key", authorized / "actor.key")
        shutil.copy(directory / "client.key", clients / "client.key")
    for public in [*directory.glob("*.key"), authorized / "actor.key", clients / "client.key"]:
        public.chmod(0o644)  # public keys are meant to be copied around
    return {
        "learner_secret": directory / "learner.key_secret",
        "learner_public": directory / "learner.key",
        "actor_secret": directory / "actor.key_secret",
        "actor_public": directory / "actor.key",
        "authorized": authorized,
        "serve_secret": directory / "serve.key_secret",
        "serve_public": directory / "serve.key",
        "client_secret": directory / "client.key_secret",
        "serve_clients": clients,
    }


def load_public(path: Path) -> bytes:
    if not path.exists():
        raise ApexError(f"CURVE key {path} not found: copy it from the directory `apex keygen` made")
    public, _ = zmq.auth.load_certificate(str(path))
    return public


@contextlib.contextmanager
def _umask(mask: int) -> Iterator[None]:
    previous = os.umask(mask)
    try:
        yield
    finally:
        os.umask(previous)


def load_keypair(path: Path) -> tuple[bytes, bytes]:
    """(public, secret) of a .key_secret file; ApexError naming `apex keygen` if absent."""
    if not path.exists():
        raise ApexError(f"CURVE key {path} not found: create keys with `apex keygen {path.parent}`")
    public, secret = zmq.auth.load_certificate(str(path))
    if not secret:
        raise ApexError(f"{path} holds no secret key: use the .key_secret file")
    return public, secret


def load_learner_public(path: Path) -> bytes:
    """The learner's public key on an actor's host; ApexError saying where it comes from."""
    if not path.exists():
        raise ApexError(f"CURVE key {path} not found: copy the learner's learner.key next to actor.key_secret")
    public, _ = zmq.auth.load_certificate(str(path))
    return public
