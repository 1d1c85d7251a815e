"""Force 8 host CPU devices before jax is imported anywhere in the test session."""
import os

flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in flags:
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count=8".strip()

import jax  # noqa: E402

assert len(jax.devices()) >= 8, "tests need 8 devices; XLA_FLAGS was set too late"
