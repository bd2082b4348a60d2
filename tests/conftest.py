import os

from hypothesis import HealthCheck, settings

settings.register_profile(
    "moeconv",
    deadline=None,
    max_examples=int(os.environ.get("MOECONV_HYPOTHESIS_EXAMPLES", "60")),
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile("moeconv")
