"""The local Ray instance the `ray`-marked tests share (one per test module, shut down after)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def ray_instance():
    ray = pytest.importorskip("ray", reason="needs the ray extra: pip install 'flashrl[ray]'")
    ray.init(num_cpus=3, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()
