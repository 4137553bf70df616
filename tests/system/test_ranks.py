"""Data-parallel learner groups as users start them (`apex learner --ranks N`, `apex run
--ranks N`): real processes over gloo on localhost, actors routed to ranks, checkpoints with
every rank's replay shard, and a rank that dies."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from apex.bench.transport import free_base_port
from apex.checkpoint import find_latest
from apex.transport.sessions import SessionSigner, SignedSessions
from tests.support.learning import assert_reached
from tests.support.processes import rss_mib, wait_for
from tests.support.runs import last_row, metrics
from tests.support.stranger import stranger_sets

FAST = [
    "--set",
    "transport.heartbeat_interval_s=0.2",
    "--set",
    "transport.heartbeat_timeout_s=1.5",
    "--set",
    "learner.metrics_interval_s=0.5",
]


def apex(*args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "apex", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def ranks_of(port: int) -> dict[int, int]:
    """rank -> pid of the learner processes of the group at --port ``port``."""
    out = subprocess.run(["pgrep", "-af", f"[-]-port {port} "], capture_output=True, text=True).stdout
    found = {}
    for line in out.splitlines():
        words = line.split()
        if "--rank" in words:
            found[int(words[words.index("--rank") + 1])] = int(words[0])
    return found


def stop_all(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.communicate()


def test_signed_sessions_take_the_group_tokens_only():
    signer = SessionSigner(b"s" * 32)
    sessions = SignedSessions(signer, 1)
    token = signer.token(3, 16, 1)
    batch = {"session": token, "actor_index": 3, "seq": 0}
    assert sessions.check_batch(batch).num_envs == 16
    with pytest.raises(Exception, match="again"):
        sessions.check_batch(batch)  # the same sequence number twice
    with pytest.raises(Exception, match="actor 4"):
        sessions.check_batch({**batch, "actor_index": 4, "seq": 1})
    forged = token[:-1] + bytes([token[-1] ^ 1])
    other_group = SessionSigner(b"t" * 32).token(3, 16, 1)
    for bad in (forged, other_group, b"x" * 16, token[:8] + (2**31).to_bytes(4, "little") + token[12:]):
        with pytest.raises(Exception, match="without a live session"):
            sessions.check_batch({**batch, "session": bad, "seq": 5})
    sessions.close_tokens([token])  # rank 0 closed it: refused from now on
    with pytest.raises(Exception, match="without a live session"):
        sessions.check_batch({**batch, "seq": 9})


def test_two_ranks_train_cartpole_and_resume_with_every_shard(tmp_path):
    """`apex learner --ranks 2` with two actors (one sends to each rank) reaches 475; its
    checkpoints hold rank 1's replay shard, and the group resumed on 2 ranks restores it."""
    port = free_base_port(span=6)
    logdir = tmp_path / "run"
    learner = apex(
        "learner",
        "--ranks",
        "2",
        "--port",
        str(port),
        "--logdir",
        str(logdir),
        "--stop-return",
        "475",
        "--stop-seconds",
        "150",
        *FAST,
    )
    actors = [
        apex(
            "actor",
            "--learner",
            f"127.0.0.1:{port}",
            "--num-envs",
            "16",
            "--set",
            "transport.heartbeat_interval_s=0.2",
            "--set",
            "transport.heartbeat_timeout_s=1.5",
        )
        for _ in range(2)
    ]
    try:
        _, err = learner.communicate(timeout=240)
        assert learner.returncode == 0, err[-3000:]
        assert_reached(json.loads((logdir / "summary.json").read_text()), 475)
        rows = metrics(logdir)
        assert all(r["ranks"] == 2 for r in rows)
        # rank 1 trained on the batches of the actor the welcome sent to it
        assert max(r["group_replay_size"] - r["replay_size"] for r in rows) > 1000
        assert "sending batches to the learner rank at 127.0.0.1:" in "".join(
            a.communicate(timeout=30)[1] for a in actors
        )
        newest = find_latest(logdir)
        assert newest.ranks == 2 and newest.shard_path(1).stat().st_size == newest.manifest["shards"][0]["bytes"]
        shard_items = newest.manifest["shards"][0]["replay_header"]["items"]
        assert shard_items[2] - shard_items[1] > 1000

        resumed = apex(
            "learner", "--ranks", "2", "--port", str(port), "--resume", str(logdir), "--stop-seconds", "1", *FAST
        )
        _, err = resumed.communicate(timeout=120)
        assert resumed.returncode == 0, err[-3000:]
        restored = f"rank 1 restored its replay shard of {newest.name}"
        assert restored in err and f"resumed from {newest.name}" in err
        assert "apex learner --resume" in err and "--ranks 2" in err  # the closing line resumes the whole group
    finally:
        stop_all([learner, *actors])


def test_a_rank_that_dies_stops_the_group_and_apex_run_starts_it_again(tmp_path):
    port = free_base_port(span=6)
    logdir = tmp_path / "run"
    run = apex(
        "run",
        "--ranks",
        "2",
        "--actors",
        "2",
        "--port",
        str(port),
        "--logdir",
        str(logdir),
        "--stop-seconds",
        "240",
        "--stop-env-steps",
        "150000",
        "--set",
        "learner.checkpoint_interval_s=1",
        *FAST,
    )
    try:
        wait_for(lambda: any(r["learner_updates"] > 50 for r in metrics(logdir)), 120, "the group to train")
        wait_for(
            lambda: find_latest(logdir).ranks == 2 if list((logdir / "checkpoints").glob("*.json")) else False,
            60,
            "a checkpoint of both ranks",
        )
        first = ranks_of(port)
        assert set(first) == {0, 1}
        os.kill(first[1], signal.SIGKILL)
        wait_for(
            lambda: set(ranks_of(port)) == {0, 1} and ranks_of(port)[1] != first[1], 60, "the group to start again"
        )
        _, err = run.communicate(timeout=240)
        assert run.returncode == 0, err[-3000:]
        assert "rank 1 exited with -9" in err and "stopping the group" in err
        assert "the learner group broke" in err  # rank 0 said why it stopped
        assert "rank 1 restored its replay shard" in err and "restarting it from its newest checkpoint" in err
        summary = json.loads((logdir / "summary.json").read_text())
        assert summary["stop_reason"] == "150000 env steps" and summary["resumed_from"] is not None
        time.sleep(0.5)
        assert ranks_of(port) == {}
    finally:
        stop_all([run])


def test_group_flags_are_checked_before_anything_starts(capsys):
    from apex.cli import main

    assert main(["run", "--ranks", "3", "--actors", "2"]) == 2
    assert "--ranks 3 needs at least as many actors" in capsys.readouterr().err
    assert main(["learner", "--rank", "1", "--world-size", "2"]) == 2
    assert "--rank, --world-size and --master go together" in capsys.readouterr().err
    assert main(["learner", "--rank", "2", "--world-size", "2", "--master", "127.0.0.1:6000"]) == 2
    assert "--rank must be in 0..1" in capsys.readouterr().err
    assert main(["learner", "--ranks", "2", "--rank", "0", "--world-size", "2", "--master", "127.0.0.1:6000"]) == 2
    assert "--ranks starts the whole group" in capsys.readouterr().err


def test_a_follower_rank_refuses_hostile_batches_counts_them_and_trains_on(tmp_path):
    """Rank 1's own trajectory port gets garbage, batches (of NaN rewards) under forged and
    foreign session tokens, each sent twice, and a batch declaring a 16 TiB array: rank 1
    lives, the group trains on, and rank 0's metrics count every refusal by reason. (Replays
    of a real token: test_signed_sessions_take_the_group_tokens_only.)"""
    import msgpack
    import numpy as np
    import zmq

    from apex.wire import protocol

    port = free_base_port(span=6)
    logdir = tmp_path / "run"
    learner = apex(
        "learner", "--ranks", "2", "--port", str(port), "--logdir", str(logdir), "--stop-seconds", "60", *FAST
    )
    actors = [apex("actor", "--learner", f"127.0.0.1:{port}", "--num-envs", "4") for _ in range(2)]
    context = zmq.Context()
    push = context.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    push.connect(f"tcp://127.0.0.1:{port + 3}")  # rank 1's trajectories
    try:
        wait_for(lambda: any(r["learner_updates"] > 20 for r in metrics(logdir)), 120, "the group to train")
        n = 64
        batch = {
            "frames": np.zeros((n + 1, 4), np.float32),
            "obs_frame": np.arange(n, dtype=np.int32),
            "next_obs_frame": np.arange(1, n + 1, dtype=np.int32),
            "action": np.zeros(n, np.int64),
            "reward": np.full(n, np.nan, np.float32),
            "discount": np.ones(n, np.float32),
            "priority": np.ones(n, np.float32),
        }
        foreign = SessionSigner(b"not the group's secret!!").token(1, 4, 1)
        for token in (foreign, b"x" * 16, foreign[:-1] + b"\0"):
            for _ in range(2):
                fields = {"actor_index": 1, "weights_version": 0, "info": {}, "session": token, "seq": 1}
                push.send_multipart(protocol.encode("batch", fields, batch))
        for _ in range(20):
            push.send_multipart([os.urandom(200)])
        empty = protocol.encode(
            "batch", {"actor_index": 1, "weights_version": 0, "info": {}, "session": foreign, "seq": 9}
        )
        header = protocol.header_of(empty)
        header["layout"] = msgpack.packb([["frames", "<f4", [2**40, 4], "lz4"]])
        push.send_multipart([*protocol.with_header(empty, header), b"\0" * 16])

        def refused() -> dict:
            rows = metrics(logdir)
            return rows[-1]["rejected_by_reason"] if rows else {}

        wait_for(
            lambda: refused().get("no_session", 0) >= 6 and refused().get("malformed", 0) >= 21,
            30,
            "rank 1's refusals to reach rank 0's metrics",
        )
        updates = metrics(logdir)[-1]["learner_updates"]
        wait_for(lambda: metrics(logdir)[-1]["learner_updates"] > updates + 20, 60, "the group to train on")
        assert set(ranks_of(port)) == {0, 1}  # both ranks alive
    finally:
        push.close()
        context.term()
        stop_all([learner, *actors])


def test_an_actor_ignores_a_malformed_trajectories_address_in_its_welcome():
    from apex.transport import ActorConnection

    client = ActorConnection("127.0.0.1", 6000)
    try:
        default = ("127.0.0.1", 6001)
        assert client._route_of(None) == default
        assert client._route_of({"host": None, "port": 6003}) == ("127.0.0.1", 6003)
        assert client._route_of({"host": "10.0.0.6", "port": 6003}) == ("10.0.0.6", 6003)
        for bad in ({"port": "6003"}, {"port": 0}, {"port": 70000}, {"host": 5, "port": 6003}, {"port": True}, []):
            assert client._route_of(bad) == default
    finally:
        client.close()


# -- hostile input, round two: a learner group against hostile peers (real processes, real sockets)


def logged(log, *args: str) -> subprocess.Popen:
    """An apex process with its output in a file (a pipe nobody reads would block it)."""
    return subprocess.Popen(
        [sys.executable, "-m", "apex", *args],
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def peer(port: int, **kwargs):
    """A hostile peer with a real session: it says hello like any actor (and keeps its
    session alive by ticking, as a live actor would)."""
    from apex.transport import ActorConnection
    from tests.support.peers import OPTIONS

    client = ActorConnection("127.0.0.1", port, num_envs=4, options=OPTIONS, **kwargs)
    client.handshake(timeout_s=60)
    return client


def routed_to_rank_1(client, port: int) -> bool:
    return client.welcome.fields["setup"].get("trajectories", {}).get("port") == port + 3


def updates_per_s(logdir, seconds: float, tick=lambda: None) -> float:
    """The group's updates a second over the next ``seconds`` (rank 0's metrics rows)."""
    first = last_row(logdir)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        tick()
        time.sleep(0.05)
    last = last_row(logdir)
    return (last["learner_updates"] - first["learner_updates"]) / (last["time"] - first["time"])


def test_a_silent_session_routed_to_rank_1_does_not_stop_the_group(tmp_path):
    """`apex learner --ranks 2` with one actor a rank trains at some rate; then rank 1's actor
    dies and a peer that says hello (routed to rank 1) and sends no batch holds its session,
    while two honest actors feed rank 0: the group goes on at half that rate or more (before
    the fix: at none, every rank waited for rank 1's batches)."""
    port = free_base_port(span=6)
    logdir = tmp_path / "run"
    actor_args = ["actor", "--learner", f"127.0.0.1:{port}", "--num-envs", "4", *FAST[:4]]
    learner = logged(
        tmp_path / "learner.log",
        "learner",
        "--ranks",
        "2",
        "--port",
        str(port),
        "--logdir",
        str(logdir),
        "--stop-seconds",
        "400",
        *FAST,
    )
    procs = [learner]
    silent = None
    try:
        procs.append(logged(tmp_path / "actor-a.log", *actor_args))
        wait_for(lambda: last_row(logdir).get("actors_connected") == 1, 120, "the first actor (rank 0's)")
        procs.append(logged(tmp_path / "actor-b.log", *actor_args))
        wait_for(
            lambda: "sending batches to the learner rank at 127.0.0.1:" in (tmp_path / "actor-b.log").read_text(),
            120,
            "the second actor to be sent to rank 1",
        )

        def rank_1_trains() -> bool:  # its replay past apex_dqn.replay.min_size: it samples
            row = last_row(logdir)
            return row.get("group_replay_size", 0) - row.get("replay_size", 0) > 3000

        wait_for(rank_1_trains, 180, "rank 1 to train on its actor's batches")
        updates_per_s(logdir, 3)
        unloaded = updates_per_s(logdir, 10)
        assert unloaded > 0

        os.killpg(procs[2].pid, signal.SIGKILL)  # rank 1's actor: its session expires
        procs[2].wait()
        wait_for(lambda: last_row(logdir).get("actors_connected") == 1, 30, "rank 1's actor to be dropped")
        silent = peer(port)
        assert routed_to_rank_1(silent, port)
        procs.append(logged(tmp_path / "actor-c.log", *actor_args))
        wait_for(
            lambda: (silent.tick(), last_row(logdir).get("actors_connected") == 3)[-1], 60, "the second honest actor"
        )
        assert "sending batches" not in (tmp_path / "actor-c.log").read_text()  # rank 0's
        updates_per_s(logdir, 5, silent.tick)  # rank 1 trains out what its replay still allows
        loaded = updates_per_s(logdir, 10, silent.tick)
        print(f"group updates/s: {unloaded:.1f} with an actor a rank, {loaded:.1f} with rank 1's session silent")
        assert loaded >= 0.5 * unloaded, (unloaded, loaded)
        row = last_row(logdir)
        assert row["actors_connected"] == 3 and set(ranks_of(port)) == {0, 1}  # the silent peer still holds its session
        assert row["steps_without_batch_by_rank"][1] > 0  # rank 1 took the group's steps without a batch
        assert learner.poll() is None
    finally:
        if silent is not None:
            silent.close()
        stop_all(procs)


def listening_of(pids) -> dict[int, set[str]]:
    """port -> addresses, of the listening TCP sockets of the processes ``pids``."""
    from pathlib import Path

    from tests.support.sockets import listening_sockets

    inodes = set()
    for pid in pids:
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[len("socket:[") : -1])
    return listening_sockets(inodes)


def refused(host: str, port: int) -> bool:
    import socket

    try:
        socket.create_connection((host, port), timeout=5).close()
    except ConnectionRefusedError:
        return True
    return False


def test_a_groups_store_listens_on_loopback_or_on_the_master_address_alone(tmp_path):
    """`apex learner --ranks 2`: every socket of its ranks listens on loopback, the rendezvous
    store (P+2+N) too, and this host's own address is refused there. Across hosts (--rank R
    --master HOST:PORT, HOST this host's address) the store listens on that address alone."""
    from tests.support.sockets import non_loopback_address

    port = free_base_port(span=6)
    logdir = tmp_path / "run"
    store = port + 4
    learner = logged(
        tmp_path / "learner.log",
        "learner",
        "--ranks",
        "2",
        "--port",
        str(port),
        "--logdir",
        str(logdir),
        "--stop-seconds",
        "300",
        *FAST,
    )
    procs = [learner]
    here = non_loopback_address()
    try:
        wait_for(lambda: metrics(logdir), 120, "the group to form")
        sockets = listening_of(ranks_of(port).values())
        assert sockets.get(store) == {"127.0.0.1"}, sockets
        assert all(addresses <= {"127.0.0.1", "::1"} for addresses in sockets.values()), sockets  # gloo's, ZeroMQ's too
        if here is not None:
            assert refused(here, store)
        stop_all(procs)
        if here is None:
            pytest.skip("this host has no address but loopback: the store across hosts was not tried")

        port = free_base_port(span=6)
        master = f"{here}:{port + 4}"
        procs = [
            logged(
                tmp_path / f"rank-{r}.log",
                "learner",
                "--rank",
                str(r),
                "--world-size",
                "2",
                "--master",
                master,
                "--port",
                str(port),
                "--logdir",
                str(tmp_path / "hosts"),
                "--stop-seconds",
                "300",
                *FAST,
            )
            for r in range(2)
        ]
        wait_for(lambda: metrics(tmp_path / "hosts"), 120, "the group across hosts to form")
        sockets = listening_of(p.pid for p in procs)
        assert sockets.get(port + 4) == {here}, sockets
        assert refused("127.0.0.1", port + 4)
    finally:
        stop_all(procs)


def test_a_batch_accepted_by_one_rank_and_resent_to_another_is_refused_and_not_credited(tmp_path):
    """Two peers with real sessions, one routed to each rank: each one's batch, accepted on
    its rank, then sent to the other rank, is refused there (wrong_rank) and its env steps
    are credited once."""
    import zmq

    from apex.wire import protocol
    from tests.support.peers import honest_batch

    port = free_base_port(span=6)
    logdir = tmp_path / "run"
    # The peers' sessions outlive a loaded machine's pauses (making a batch ticks nothing).
    learner = logged(
        tmp_path / "learner.log",
        "learner",
        "--ranks",
        "2",
        "--port",
        str(port),
        "--logdir",
        str(logdir),
        "--stop-seconds",
        "300",
        *FAST,
        "--set",
        "transport.heartbeat_timeout_s=30",
    )
    context = zmq.Context()
    peers = []
    try:
        peers.append(peer(port))
        peers.append(peer(port))
        on_rank_0, on_rank_1 = peers
        assert not routed_to_rank_1(on_rank_0, port) and routed_to_rank_1(on_rank_1, port)

        def tick():
            for p in peers:
                p.tick()

        def env_steps() -> int:
            tick()
            return last_row(logdir).get("env_steps", 0)

        def rejected(reason: str) -> int:
            tick()
            return last_row(logdir).get("rejected_by_reason", {}).get(reason, 0)

        credited = 0
        for sender, other_port in ((on_rank_1, port + 1), (on_rank_0, port + 3)):
            batch = honest_batch(sender)
            frames = protocol.encode(
                "batch",
                {
                    "actor_index": sender.actor_index,
                    "weights_version": 0,
                    "info": {},
                    "session": sender._session,
                    "seq": sender._seq,
                },
                batch,
            )
            sender.tick()
            assert sender.send_frames(frames, timeout_s=20)  # on its own rank
            wait_for(lambda: env_steps() > credited, 60, "the batch to be credited on its rank")
            time.sleep(1.0)  # a few syncs: all of it is counted
            credited = env_steps()
            wrong_rank = rejected("wrong_rank")
            push = context.socket(zmq.PUSH)
            push.connect(f"tcp://127.0.0.1:{other_port}")  # the other rank's trajectories
            push.send_multipart(frames)
            push.close(linger=5000)
            wait_for(lambda: rejected("wrong_rank") > wrong_rank, 30, f"the batch refused on port {other_port}")
            time.sleep(1.0)
            assert env_steps() == credited, "a batch sent to a second rank was credited twice"
        assert set(ranks_of(port)) == {0, 1} and learner.poll() is None
    finally:
        for p in peers:
            p.close()
        context.term()
        stop_all([learner])


def garbage_to_every_listener(pids) -> list[int]:
    """A burst of random bytes, then a hang-up, on every TCP port the ``pids`` listen on
    (gloo's, ZeroMQ's, the store's): the ports it reached."""
    import socket

    reached = []
    for port in listening_of(pids):
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=2) as raw:
                raw.sendall(os.urandom(64 * 1024))
            reached.append(port)
        except OSError:
            pass
    return reached


def test_a_stranger_on_the_host_can_neither_write_into_the_groups_store_nor_stop_the_group(tmp_path):
    """`apex learner --ranks 2` and an actor: a process of this host that is not a rank
    tries 32 keys of 4 MiB at the store (CURVE keys of its own, then raw bytes) and sends
    random bytes to every listening port of both ranks. The store answers none of it, rank
    0 grows by less than 16 MiB, the refusals are counted, and the group trains on. (With
    torch's TCPStore every set succeeded and rank 0 grew by 141 MiB.)"""
    port = free_base_port(span=6)
    logdir = tmp_path / "run"
    group = ["--ranks", "2", "--port", str(port), "--logdir", str(logdir), "--stop-seconds", "300", *FAST]
    learner = logged(tmp_path / "learner.log", "learner", *group)
    actor = logged(tmp_path / "actor.log", "actor", "--learner", f"127.0.0.1:{port}", *FAST[:4])
    procs = [learner, actor]
    try:
        wait_for(lambda: last_row(logdir).get("learner_updates", 0) > 100, 120, "the group to train")
        ranks = ranks_of(port)
        before = rss_mib(ranks[0])
        assert not stranger_sets("127.0.0.1", port + 4, keys=32, value_bytes=4 << 20), "the store answered a stranger"
        reached = garbage_to_every_listener(ranks.values())
        assert port + 4 in reached and len(reached) >= 4, reached  # the store, the learner's ports, gloo's
        grown = rss_mib(ranks[0]) - before
        assert grown < 16, f"rank 0 grew by {grown:.1f} MiB"
        updates = last_row(logdir)["learner_updates"]
        wait_for(lambda: last_row(logdir)["learner_updates"] > updates + 200, 60, "the group to train on")
        assert ranks_of(port) == ranks  # neither rank died (nor was started again)
        refusals = last_row(logdir)["group_store_refusals"]
        assert refusals >= 1
        print(f"stranger: rank 0 grew {grown:.1f} MiB, {len(reached)} ports reached, {refusals} refusals counted")
        assert learner.poll() is None
    finally:
        stop_all(procs)
    assert "turned away a client without the run's key" in (tmp_path / "learner.log").read_text()
