"""Where the repository's files are, for a test file at any depth under tests/."""

from __future__ import annotations

from pathlib import Path

# The repository root: tests/support/paths.py -> tests/support -> tests -> the root.
ROOT = Path(__file__).resolve().parents[2]
