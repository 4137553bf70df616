"""The README's promises that CI depends on."""

from tests.support.paths import ROOT

TEST_COMMAND = "pip install -c constraints.txt -e '.[test]' && pytest"


def test_ci_runs_the_readme_test_command():
    assert TEST_COMMAND in (ROOT / "README.md").read_text()
    assert TEST_COMMAND in (ROOT / ".ci" / "run").read_text()


def test_constraints_pin_the_local_torch_build():
    assert "torch==2.13.0" in (ROOT / "constraints.txt").read_text().splitlines()
