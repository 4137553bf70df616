import os

from hypothesis import HealthCheck, settings

# Deterministic property tests: the same examples on every run, no flaky deadlines on a
# loaded 2-core CI machine.
settings.register_profile(
    "default",
    derandomize=True,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))
