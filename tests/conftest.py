"""Shared test fixtures.  The runtime environment (loopback-only Ray/Mooncake, offline hub, CPU vLLM settings) is
applied before anything imports ray, vllm or mooncake."""
from __future__ import annotations

import os

from pipeline.core.runtime import apply_env

os.environ.setdefault("DSPARK_WORK_DIR", os.path.join(os.path.dirname(os.path.dirname(__file__)), "work"))
apply_env()

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def target_dir():
    """The real target (SmolLM2-135M-Instruct), converted once by scripts/setup.sh (or here, if missing)."""
    from pipeline.data.target_model import prepare_smollm2

    return prepare_smollm2()


@pytest.fixture(scope="session")
def ray_session():
    """ONE local Ray cluster for the whole test session (Ray start costs seconds and GBs)."""
    from pipeline.core.runtime import init_ray

    ray = init_ray(num_cpus=4)
    yield ray
    ray.shutdown()
