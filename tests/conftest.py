"""Shared fixtures: an isolated state directory per test, tiny checkpoints built once per session."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

# Where expensive, reproducible artefacts (tiny checkpoints, the converted default model) are kept
# between test runs. Never committed; rebuilt when missing.
TEST_CACHE = Path(os.environ.get("BATCHRUN_TEST_CACHE", Path.home() / ".cache" / "batchrun-tests"))


@pytest.fixture(scope="session")
def machine_measurements(tmp_path_factory) -> Path:
    """Compute rate, runtime overhead and a layer call's fixed cost, measured once per session (each costs
    seconds)."""
    import os as _os

    from batchrun import measure

    home = tmp_path_factory.mktemp("measure-home")
    previous = _os.environ.get("BATCHRUN_HOME")
    _os.environ["BATCHRUN_HOME"] = str(home)
    try:
        for dtype in ("float32", "bfloat16"):  # bfloat16: what --dtype auto may pick for a bfloat16 checkpoint
            measure.compute_rate(dtype, "cpu")
            measure.memory_read_rate(dtype, "cpu")
        measure.runtime_overhead_bytes()
        measure.layer_call_seconds("cpu")
    finally:
        if previous is None:
            del _os.environ["BATCHRUN_HOME"]
        else:
            _os.environ["BATCHRUN_HOME"] = previous
    return home / measure.MEASUREMENTS_FILE


@pytest.fixture(autouse=True)
def isolated_state(tmp_path_factory, monkeypatch, machine_measurements):
    """Each test gets its own BATCHRUN_HOME so no test sees another's database; the machine's
    measurements are copied in so each test does not spend seconds re-measuring them."""
    import shutil

    home = tmp_path_factory.mktemp("batchrun-home")  # outside tmp_path, which tests list
    shutil.copy(machine_measurements, home / machine_measurements.name)
    monkeypatch.setenv("BATCHRUN_HOME", str(home))
    monkeypatch.delenv("BATCHRUN_STREAMING", raising=False)
    yield home
    _keep_decode_rates(home / machine_measurements.name, machine_measurements)


def _keep_decode_rates(measured, seeded) -> None:
    """A model's decode rates (measure.decode_rates) take seconds to measure: the ones a test measured are seeded
    into the homes of the tests after it, as the session's other measurements are."""
    import json

    try:
        found = json.loads(measured.read_text()).get("decode")
    except (OSError, ValueError):
        return
    if found:
        measurements = json.loads(seeded.read_text())
        measurements.setdefault("decode", {}).update(found)
        seeded.write_text(json.dumps(measurements))


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
    from batchrun.checkpoint.default_model import default_model

    return default_model(home=test_cache / "default-home")
