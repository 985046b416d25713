"""What one forward call of a decoder layer costs beyond its matmuls and its memory traffic: the Python of
transformers' module, the dispatch of its dozen-odd small ops (norms, rotary, activation, residual adds, the cache
update, attention). A decode step of a small model is largely this: its weights and FLOPs leave much of the pass
unaccounted for (docs/planning.md#time).

Timed on a tiny Llama built from a transformers config (every weight a few KiB, so nothing but the fixed cost is
left): decode steps of a 9-layer model against a 1-layer one, in alternating rounds, so the embedding, the head and
the call into the model cancel out. Other families' layers run about as many ops (Gemma adds two norms); the plan
takes the Llama figure for all of them. Importing this module imports no torch.
"""
from __future__ import annotations

import time

from batchrun.measure.cache import cached, compute_key, store

PROBE_CONFIG = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                    vocab_size=256, max_position_embeddings=256)
PROBE_LAYERS = (1, 9)
PROBE_SEQUENCES = 16  # a decode call's rows: what the fixed cost is paid beside
PROBE_CONTEXT = 64
PROBE_ROUNDS = 7
STEPS_PER_ROUND = 5


def seconds_per_layer_call(device: str = "cpu") -> float:
    """Seconds one decoder layer's forward call costs on `device` with nothing to compute (cost_per_layer of the
    probe models' rounds; other work on the machine only ever slows a round, so the fastest counts). Timed on one
    torch thread: the cost is Python and dispatch, which threads do not share, and a team of threads meeting at
    every tiny op waits on any core another process holds, which can multiply the cost (docs/performance.md#probes)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return cost_per_layer(_timed_rounds(device))
    finally:
        torch.set_num_threads(threads)


def _timed_rounds(device: str) -> dict[int, list[float]]:
    import torch

    models = {layers: _probe_model(layers, device) for layers in PROBE_LAYERS}
    wait = torch.cuda.synchronize if str(device).startswith("cuda") else (lambda: None)
    timings: dict[int, list[float]] = {layers: [] for layers in PROBE_LAYERS}
    with torch.inference_mode():
        steps = {layers: _decode_step(model, device) for layers, model in models.items()}
        for step in steps.values():  # untimed: first touch, kernel selection
            step()
        for _ in range(PROBE_ROUNDS):
            for layers, step in steps.items():
                wait()
                start = time.perf_counter()
                for _ in range(STEPS_PER_ROUND):
                    step()
                wait()
                timings[layers].append((time.perf_counter() - start) / STEPS_PER_ROUND)
    return timings


def cost_per_layer(timings: dict[int, list[float]]) -> float:
    """{layers: seconds of each round's decode step} -> seconds a layer adds: the probe models' fastest rounds apart,
    over the layers they differ by; never below zero (noise on a machine where a layer costs next to nothing)."""
    fewer, more = PROBE_LAYERS
    return max((min(timings[more]) - min(timings[fewer])) / (more - fewer), 0.0)


def _probe_model(layers: int, device: str):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(num_hidden_layers=layers, **PROBE_CONFIG)
    return LlamaForCausalLM(config).eval().to(device)


def _decode_step(model, device: str):
    """A function running one decode step of PROBE_SEQUENCES sequences after PROBE_CONTEXT cached tokens; the cache
    is cut back after each step, so every step attends to the same context."""
    import torch

    from batchrun.runtime import cache_argument, output_cache

    generator = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    prompt = torch.randint(0, vocab, (PROBE_SEQUENCES, PROBE_CONTEXT), generator=generator).to(device)
    token = torch.randint(0, vocab, (PROBE_SEQUENCES, 1), generator=generator).to(device)
    cache = output_cache(model(input_ids=prompt, use_cache=True))
    argument = cache_argument(model)

    def step() -> None:
        model(input_ids=token, use_cache=True, **{argument: cache})
        cache.crop(-1)  # the token just appended (a negative count removes, in every transformers release)

    return step


def layer_call_seconds(device: str = "cpu") -> float:
    """Seconds one forward call through a decoder layer costs besides its matmuls and memory traffic
    (measure/layer_call.py): what a small model's decode step mostly is. Cached per device, thread count and
    transformers release (the cost is its modules' Python)."""
    import torch

    key = compute_key("float32", device, torch.get_num_threads())
    entry = cached("layer_call", key)
    if entry:
        return entry["seconds"]
    seconds = seconds_per_layer_call(device)
    store("layer_call", key, {"seconds": seconds})
    return seconds
