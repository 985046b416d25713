"""Shared fixtures: an isolated state directory per test, tiny checkpoints built once per session."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

# Where expensive, reproducible artefacts (tiny checkpoints, the converted default model) are kept
# between test runs. Never committed; rebuilt when missing.
TEST_CACHE = Path(os.environ.get("BATCHRUN_TEST_CACHE", Path.home() / ".cache" / "batchrun-tests"))


@pytest.fixture(autouse=True)
def isolated_state(tmp_path, monkeypatch):
    """Each test gets its own BATCHRUN_HOME so no test sees another's database or measurements."""
    home = tmp_path / "batchrun-home"
    monkeypatch.setenv("BATCHRUN_HOME", str(home))
    monkeypatch.delenv("BATCHRUN_STREAMING", raising=False)
    return home


@pytest.fixture(scope="session")
def test_cache() -> Path:
    TEST_CACHE.mkdir(parents=True, exist_ok=True)
    return TEST_CACHE


@pytest.fixture(scope="session")
def tiny_checkpoint(test_cache):
    """tiny_checkpoint(arch) -> path of a tiny random-weight safetensors checkpoint with a tokenizer."""
    from tests.tiny_models import build_tiny_checkpoint

    def get(arch: str) -> Path:
        return build_tiny_checkpoint(arch, test_cache / "tiny")

    return get


@pytest.fixture(scope="session")
def default_checkpoint(test_cache):
    """The converted SmolLM2-135M-Instruct checkpoint, provisioned once into the test cache."""
    from batchrun.default import default_model

    return default_model(home=test_cache / "default-home")
