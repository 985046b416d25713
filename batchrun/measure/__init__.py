"""What the plan learns from this machine: disk read bandwidth, compute and memory rates, a layer call's fixed cost,
GGUF dequantization rates and the runtime's own memory, each measured once and cached with the identity of what it
measured (and measured again where a run disputes it). No torch at import; measuring imports it.
"""
from batchrun.measure.cache import MEASUREMENTS_FILE
from batchrun.measure.compute import (compute_rate, compute_threads, decode_rates, dispute_compute_rate,
                                      dispute_generation_rates, judge_compute_rate, judge_generation_rates,
                                      linear_kernel, measure_compute_rate,
                                      measure_memory_read_rate, memory_read_rate, packs_weights)
from batchrun.measure.dequantize import dequantize_rates, judge_dequantize_rates
from batchrun.measure.disk import cached_bandwidth, measure_read_bandwidth
from batchrun.measure.layer_call import layer_call_seconds
from batchrun.measure.overhead import (judge_runtime_overhead, record_runtime_import, runtime_import_seconds,
                                       runtime_overhead_bytes)

__all__ = ["MEASUREMENTS_FILE", "cached_bandwidth", "compute_rate", "compute_threads", "decode_rates",
           "dequantize_rates", "dispute_compute_rate", "dispute_generation_rates", "judge_compute_rate",
           "judge_dequantize_rates", "judge_generation_rates", "judge_runtime_overhead", "layer_call_seconds",
           "linear_kernel", "measure_compute_rate", "measure_memory_read_rate", "measure_read_bandwidth",
           "memory_read_rate", "packs_weights", "record_runtime_import", "runtime_import_seconds",
           "runtime_overhead_bytes"]
