"""The files `apex run --ray` puts on a node (apex.run.node_files): 0600 in 0700 from their
creation, and removed by the janitor when the process that wrote them dies without closing
(as a Ray worker on a node that is killed)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from apex.run.node_files import NodeFiles
from tests.support.paths import ROOT

WRITER = """
import os, sys
from apex.run.node_files import NodeFiles
files = NodeFiles({"config.yaml": b"algo: impala", "keys/actor.key_secret": b"secret"}, sys.argv[1])
print(files.write(), flush=True)
sys.stdin.read()  # until the test kills this process
"""


def test_node_files_are_private_and_go_when_their_writer_is_killed():
    writer = subprocess.Popen(
        [sys.executable, "-c", WRITER, f"apex-ray-test{os.getpid()}-actor-0"],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    directory = Path(writer.stdout.readline().strip())
    try:
        assert directory.stat().st_mode & 0o777 == 0o700 and (directory / "keys").stat().st_mode & 0o777 == 0o700
        for file in ("config.yaml", "keys/actor.key_secret"):
            assert (directory / file).stat().st_mode & 0o777 == 0o600, file
        time.sleep(1.0)  # the janitor's polls while the writer lives leave its files alone
        assert (directory / "keys" / "actor.key_secret").read_bytes() == b"secret"
    finally:
        writer.kill()  # SIGKILL: nothing of it can clean up
        writer.wait()
    deadline = time.monotonic() + 10
    while directory.exists():
        assert time.monotonic() < deadline, f"{directory} outlived its writer by 10 s"
        time.sleep(0.1)


def test_a_node_file_cannot_name_a_place_outside_its_directory():
    for name in ("../escape", "/etc/passwd"):
        with pytest.raises(ValueError, match="stay in its directory"):
            NodeFiles({name: b"x"}, "apex-ray-x-actor-0")
    with pytest.raises(ValueError, match="named apex-ray-"):
        NodeFiles({}, "../tmp")
