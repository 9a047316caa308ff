"""Shared test fixtures. Every model is built from a config with random weights: nothing is downloaded."""

from __future__ import annotations

import os
import zlib

import pytest
import torch

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture
def gen(request) -> torch.Generator:
    """A generator seeded from the test's id: inputs are fresh per test and reproducible per test."""
    return torch.Generator().manual_seed(zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """Build-once tiny checkpoints: `tiny_models(family, **overrides)` returns a saved model dir."""
    from flashrl.testing import save_tiny_model

    cache: dict[tuple, object] = {}

    def build(family: str = "qwen2", seed: int = 0, **overrides):
        key = (family, seed, tuple(sorted((k, repr(v)) for k, v in overrides.items())))
        if key not in cache:
            path = tmp_path_factory.mktemp(f"{family}-{len(cache)}")
            cache[key] = save_tiny_model(path, family, seed=seed, **overrides)
        return cache[key]

    return build
