"""Decode-pass seconds of one checkpoint streamed: a safetensors directory or a GGUF file, each in its own process.

    .venv/bin/python -m benchmarks.gguf_decode_pass MODEL [MODEL ...] [--rows 24] [--prompt 110] [--passes 7]

Each model: page cache dropped (as root), a prompt pass of `rows` sequences, then `passes` decode passes
(`StreamedModel.run_pass(..., light=True)`, what a generation job's decode passes run), bf16 compute. Prints the median
of all but the first decode pass and the bytes a pass read. What benchmarks.gguf_stream times end to end under a
cgroup cap, this times pass by pass, so a file's decode cost is seen apart from its prefill and the plan.
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time


def decode_passes(model: str, rows: int, prompt: int, passes: int) -> None:
    import torch

    from batchrun.runtime import StreamedModel

    subprocess.run("sync; echo 3 > /proc/sys/vm/drop_caches", shell=True, check=False, stderr=subprocess.DEVNULL)
    ids = torch.randint(100, 30000, (rows, prompt), generator=torch.Generator().manual_seed(0))
    with StreamedModel(model, device="cpu", dtype="bfloat16") as streamed:
        first = streamed.run_pass([lambda: streamed.model(ids, use_cache=True)])[0]
        cache, following = first.past_key_values, first.logits[:, -1:].argmax(-1)
        seconds, read_before = [], streamed.loader.bytes_read
        for _ in range(passes):
            started = time.perf_counter()
            step = streamed.run_pass([lambda: streamed.model(following, cache=cache)], light=True)[0]
            seconds.append(time.perf_counter() - started)
            cache, following = step.past_key_values, step.logits[:, -1:].argmax(-1)
        read = (streamed.loader.bytes_read - read_before) / passes
    print(f"{model}: decode pass median {statistics.median(seconds[1:]):.2f} s "
          f"({', '.join(f'{s:.2f}' for s in seconds)}), {read / 1e9:.2f} GB a pass", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="+")
    parser.add_argument("--rows", type=int, default=24)
    parser.add_argument("--prompt", type=int, default=110)
    parser.add_argument("--passes", type=int, default=7)
    parser.add_argument("--one", help=argparse.SUPPRESS)  # the child process's model
    args = parser.parse_args()
    if args.one:
        decode_passes(args.one, args.rows, args.prompt, args.passes)
        return
    for model in args.models:  # each in a fresh process: its own memory, its own caches
        subprocess.run([sys.executable, "-m", "benchmarks.gguf_decode_pass", model, "--one", model,
                        "--rows", str(args.rows), "--prompt", str(args.prompt), "--passes", str(args.passes)],
                       check=True)


if __name__ == "__main__":
    main()
