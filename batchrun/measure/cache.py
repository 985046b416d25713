"""The measurements file: state_dir()/measurements.json, one section per kind of figure, each entry with the
identity of what it measured (host.machine). A figure whose identity differs from this machine's is measured
again, and so is one a run disputed (dispute: the run's passes disagreed with it); a damaged file is simply replaced
by the next measurement.
"""
from __future__ import annotations

import json
import os
from datetime import datetime, timezone

from batchrun.host import NATIVE_DEFAULTS, disk_identity, kernels_identity, package_version, state_dir

MEASUREMENTS_FILE = "measurements.json"


SHAPES_SEPARATOR = "|"  # decode keys: "<compute key>|<digest of the layer's shapes>"


def compute_key(dtype: str, device: str, threads: int) -> str:
    return f"{device}:{dtype}:threads={threads}"


def load() -> dict:
    try:
        return json.loads((state_dir() / MEASUREMENTS_FILE).read_text())
    except (OSError, json.JSONDecodeError):
        return {}  # nothing measured yet, or a damaged file that the next measurement replaces


def cached(section: str, key: str) -> dict | None:
    """A figure cached for `key`, if it was measured on what this process runs on (host.machine)."""
    entry = load().get(section, {}).get(key)
    if entry is None or entry.get("disputed") or entry.get("machine") != identity(section, key):
        return None
    return entry


def dispute(section: str, key: str, evidence: dict) -> bool:
    """Mark the cached figure as contradicted by what a run observed (`evidence`, kept with it until it is measured
    again): the next plan measures it afresh instead of trusting a figure taken, say, while the machine was busy.
    False when there is no such figure to dispute."""
    measurements = load()
    entry = measurements.get(section, {}).get(key)
    if entry is None or entry.get("disputed"):
        return False
    entry["disputed"] = {**evidence, "at": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    write(measurements)
    return True


def identity(section: str, key: str) -> dict:
    """What a figure of `section` depends on besides its key: the disk's mount for a bandwidth; the processor and
    torch build for a rate, and the accelerator's name off the CPU; for a layer call's cost also transformers; for
    the runtime's memory also transformers and the native libraries' cache settings (native_env: a user's own cache
    capacity changes what the runtime holds, docs/performance.md#native-library-caches)."""
    if section == "bandwidth":
        return disk_identity(int(key))
    identity = kernels_identity()
    if section == "runtime_overhead":
        return {**identity, "transformers": package_version("transformers"),
                "native": {name: os.environ.get(name) for name in NATIVE_DEFAULTS}}
    if section == "layer_call":
        identity = {**identity, "transformers": package_version("transformers")}
    device = key.split(SHAPES_SEPARATOR)[0].rsplit(":", 2)[0]  # "<device>:<dtype>:threads=<n>[|<shapes>]"
    if device.split(":")[0] != "cpu":
        identity["accelerator"] = _accelerator_name(device)
    return identity


def _accelerator_name(device: str) -> str:
    import torch

    if device.split(":")[0] == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_name(device)
    return device


def store(section: str, key: str, entry: dict) -> None:
    measurements = load()
    entry = {**entry, "machine": identity(section, key),
             "measured_at": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    measurements.setdefault(section, {})[key] = entry
    write(measurements)


def write(measurements: dict) -> None:
    file = state_dir() / MEASUREMENTS_FILE
    temporary = file.with_suffix(f".{os.getpid()}.tmp")
    try:
        temporary.write_text(json.dumps(measurements, indent=2))
        os.replace(temporary, file)  # atomic: a concurrent reader sees the old or the new file, never half
    except OSError:
        # A full disk must not stop a job over a cache: the figure is simply measured again next time.
        temporary.unlink(missing_ok=True)
