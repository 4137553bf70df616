"""Config values from elsewhere that no config may hold."""

from __future__ import annotations

HUGE = "1" * 5000  # past int()'s 4,300 digits: PyYAML's int() raised ValueError, a traceback
