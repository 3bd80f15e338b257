"""A Ray cluster shared by the tests/cluster modules (a Ray start costs seconds on 2 cores). The
multi-node module shuts it down to start its own Cluster; the next module that asks for `ray_local`
starts the local one again. Helpers live in ray_helpers.py."""

from __future__ import annotations

import pytest
from ray_helpers import start_local_ray


@pytest.fixture(scope="session")
def ray_session():
    import ray

    start_local_ray()
    yield
    ray.shutdown()


@pytest.fixture
def ray_local(ray_session):
    start_local_ray()  # again if the multi-node module took the cluster down
