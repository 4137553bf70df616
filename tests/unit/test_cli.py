"""The `apex` command line in-process: argument checks, flags' environment-variable defaults,
keygen (the console script and the benchmarks as a user runs them: tests/system/test_cli.py)."""

from __future__ import annotations

import pytest

from apex.cli import main


def test_bench_rejects_unknown_benchmark(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "nope"])
    assert exit_info.value.code == 2
    assert "invalid choice: 'nope'" in capsys.readouterr().err


def test_bench_rejects_non_positive_seconds(capsys):
    assert main(["bench", "sumtree", "--seconds", "0"]) == 2
    assert "--seconds must be positive" in capsys.readouterr().err


def test_keygen_writes_usable_keys_and_refuses_to_overwrite(tmp_path, capsys):
    import zmq.auth

    assert main(["keygen", str(tmp_path / "keys")]) == 0
    out = capsys.readouterr().out
    assert "actor.key_secret" in out
    public, secret = zmq.auth.load_certificate(str(tmp_path / "keys" / "learner.key_secret"))
    assert len(public) == 40 and len(secret) == 40
    assert (tmp_path / "keys" / "authorized" / "actor.key").read_bytes() == (
        tmp_path / "keys" / "actor.key"
    ).read_bytes()
    assert (tmp_path / "keys" / "actor.key_secret").stat().st_mode & 0o077 == 0
    assert main(["keygen", str(tmp_path / "keys")]) == 2
    assert "choose an empty directory" in capsys.readouterr().err


def test_flags_default_to_environment_variables(monkeypatch):
    from apex.cli import build_parser

    monkeypatch.setenv("APEX_LEARNER", "10.0.0.5:6000")
    monkeypatch.setenv("APEX_NUM_ENVS", "8")
    monkeypatch.setenv("APEX_PORT", "7000")
    monkeypatch.setenv("APEX_LOGDIR", "/tmp/somewhere")
    monkeypatch.setenv("APEX_CURVE_DIR", "/keys")
    parser = build_parser()
    actor = parser.parse_args(["actor"])
    assert (actor.learner, actor.num_envs, actor.curve_dir) == ("10.0.0.5:6000", 8, "/keys")
    learner = parser.parse_args(["learner"])
    assert (learner.port, learner.logdir) == (7000, "/tmp/somewhere")
    assert parser.parse_args(["learner", "--port", "7100"]).port == 7100  # a flag wins


def test_bad_environment_variable_is_a_clear_error(monkeypatch):
    from apex.cli import build_parser

    monkeypatch.setenv("APEX_PORT", "fifty")
    with pytest.raises(SystemExit, match="APEX_PORT='fifty' is not a valid int"):
        build_parser()


def test_bench_rejects_bad_actor_counts(capsys):
    assert main(["bench", "e2e", "--actors", "0,2"]) == 2
    assert "--actors counts must be >= 1" in capsys.readouterr().err
    assert main(["bench", "learner", "--ranks", "1,x"]) == 2
    assert "--ranks takes a comma-separated list" in capsys.readouterr().err
