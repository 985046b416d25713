"""What the machine says: memory and cgroups, the heap, processes, signals, CPU features, the state directory, and
the tracebacks of failures batchrun did not foresee. Below every other layer; no torch at import.
"""
from batchrun.host.compute_dtype import auto_compute_dtype, cpu_auto_reason, cpu_bfloat16_feature
from batchrun.host.heap import glibc, keep_freed_pages_below, keep_heap_flat, return_freed_memory
from batchrun.host.machine import disk_identity, kernels_identity, package_version
from batchrun.host.memory import (CGROUP_ROOT, anonymous_resident_bytes, available_memory_bytes, disk_free_bytes,
                                  peak_resident_bytes, reset_peak_resident, resident_bytes)
from batchrun.host.native_env import NATIVE_DEFAULTS, apply_native_defaults
from batchrun.host.oom import batch_cap_after_oom, killed_by_oom, memory_cgroup_dir, oom_kill_count
from batchrun.host.paths import default_db_path, state_dir, stored_spec
from batchrun.host.processes import HOST, pid_alive, process_identity
from batchrun.host.signals import Stopped, interrupts_deferred, stop_signals_unwind, stops_deferred
from batchrun.host.tracebacks import failure_reason, one_line, redacted, save_traceback, secrets_in

__all__ = ["CGROUP_ROOT", "HOST", "NATIVE_DEFAULTS", "Stopped", "anonymous_resident_bytes", "apply_native_defaults",
           "auto_compute_dtype", "available_memory_bytes", "batch_cap_after_oom", "cpu_auto_reason",
           "cpu_bfloat16_feature", "default_db_path", "disk_free_bytes", "disk_identity", "failure_reason", "glibc",
           "interrupts_deferred", "keep_freed_pages_below", "keep_heap_flat", "kernels_identity", "killed_by_oom",
           "memory_cgroup_dir", "one_line", "oom_kill_count", "package_version", "peak_resident_bytes", "pid_alive",
           "process_identity", "redacted", "reset_peak_resident", "resident_bytes", "return_freed_memory",
           "save_traceback", "secrets_in", "state_dir", "stop_signals_unwind", "stops_deferred", "stored_spec"]
