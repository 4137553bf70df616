"""apex.config.trust: what a config from elsewhere (a checkpoint's, a learner's welcome) may
make this process import. The real processes (apex eval, actor, serve, --resume) attacked
through it are in tests/system/test_hostile.py
(test_a_checkpoint_whose_config_names_code_runs_none_of_it,
test_a_forged_welcome_makes_actors_and_serve_run_no_code)."""

from __future__ import annotations

import sys

import pytest

from apex import config as config_module
from apex.config.trust import (
    ALLOW_IMPORTS_ENV,
    allowed_imports,
    check_imports,
    from_elsewhere,
    is_allowed,
    named_modules,
)
from apex.errors import ConfigError

HOSTILE = {
    "env": {
        "id": "evil.pkg:Evil-v0",
        "imports": ["os"],
        "wrappers": ["pydoc.pipepager", {"type": "gymnasium.wrappers:ClipReward", "kwargs": {}}],
    }
}


def test_named_modules_are_what_making_the_environment_would_import_in_order():
    env = config_module.from_dict(HOSTILE).env
    assert named_modules(env) == [
        ("env.imports[0]", "os"),
        ("env.id", "evil.pkg"),
        ("env.wrappers[0] 'pydoc.pipepager'", "pydoc"),
        ("env.wrappers[1] 'gymnasium.wrappers:ClipReward'", "gymnasium.wrappers"),
    ]
    assert named_modules(config_module.EnvConfig(id="ALE/Pong-v5")) == []  # installed ids import nothing named


@pytest.mark.parametrize(
    "module, allowed, expected",
    [
        ("pydoc", ["pydoc"], True),
        ("gymnasium.wrappers", ["gymnasium"], True),  # a package allows its submodules
        ("gymnasium", ["gymnasium.wrappers"], False),  # not its parents
        ("pydocx", ["pydoc"], False),  # a name is not a prefix of another
        ("evil.pkg", [], False),
    ],
)
def test_a_module_is_allowed_by_its_own_name_or_a_package_it_is_in(module, allowed, expected):
    assert is_allowed(module, allowed) is expected


def test_a_config_from_elsewhere_is_refused_in_one_line_naming_the_module_and_the_flag():
    with pytest.raises(ConfigError) as e:
        from_elsewhere(HOSTILE, ["os", "evil"], "checkpoint x.pt")
    message = str(e.value)
    assert "\n" not in message and message.startswith("checkpoint x.pt names module 'pydoc' (env.wrappers[0]")
    assert "--allow-import pydoc" in message and ALLOW_IMPORTS_ENV in message
    config = from_elsewhere(HOSTILE, ["os", "evil", "pydoc", "gymnasium"], "checkpoint x.pt")
    assert config.env.id == "evil.pkg:Evil-v0"
    assert "evil" not in sys.modules  # checking imports nothing


def test_the_allow_list_inside_a_config_from_elsewhere_is_not_this_sides_word():
    raw = {"env": {**HOSTILE["env"], "allow_imports": ["os", "evil", "pydoc", "gymnasium"]}}
    with pytest.raises(ConfigError, match="module 'os'"):
        from_elsewhere(raw, allowed_imports(), "the welcome")


def test_local_overrides_apply_before_the_check():
    # --set on a resume may drop what the checkpoint named
    config = from_elsewhere(HOSTILE, [], "checkpoint x.pt", ["env.id=CartPole-v1", "env.imports=[]", "env.wrappers=[]"])
    check_imports(config.env, [], "checkpoint x.pt")


def test_the_allowance_comes_from_flags_the_variable_and_the_local_config(monkeypatch):
    monkeypatch.setenv(ALLOW_IMPORTS_ENV, " tests.envs, ,pydoc ")
    local = config_module.load(None, ["env.allow_imports=[mypkg.envs]", "env.imports=[corridor]"]).env
    # the local config is this side's own: what it names itself is allowed too
    assert allowed_imports(["gymnasium.wrappers", "pydoc"], local) == (
        "gymnasium.wrappers",
        "pydoc",
        "tests.envs",
        "mypkg.envs",
        "corridor",
    )
    with pytest.raises(ConfigError, match=r"^--allow-import 'a b' is not a module name"):
        allowed_imports(["a b"])
    monkeypatch.setenv(ALLOW_IMPORTS_ENV, "os;rm")
    with pytest.raises(ConfigError, match=f"^{ALLOW_IMPORTS_ENV} 'os;rm' is not a module name"):
        allowed_imports()
    with pytest.raises(ConfigError, match=r"env.allow_imports\[0\] must be a module name"):
        config_module.load(None, ["env.allow_imports=['../x']"])
