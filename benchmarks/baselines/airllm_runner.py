"""Baseline: AirLLM (PyPI `airllm`), one prompt at a time as its API is meant to be used.

Runs in its own virtual environment (AirLLM pins its own dependencies), from the repository root:

    /work/bench-venv/bin/python -m benchmarks.baselines.airllm_runner JOB.json RESULT.json --split-dir DIR
    /work/bench-venv/bin/python -m benchmarks.baselines.airllm_runner JOB.json - --split-dir DIR --prepare

AirLLM first splits the checkpoint into one safetensors file per layer under DIR/splitted_model (a second copy of
the weights on disk); `--prepare` does only that, outside any measurement. Measured runs then stream every module
(embedding, decoder layers, norm, head) from those files with its own prefetch, computing in the job's dtype like the
other runners. It needs the checkpoint's tokenizer (the benchmark checkpoint ships one).
"""
from __future__ import annotations

import argparse
import sys
import time

import torch

from benchmarks.baselines.common import (ForwardClock, Job, RunnerResult, choice_token_ids, disk_read_bytes,
                                         encode_prompts, generated_tokens)


def open_model(job: Job, split_dir: str):
    from airllm import AutoModel

    return AutoModel.from_pretrained(job.checkpoint, device="cpu", dtype=getattr(torch, job.dtype),
                                     layer_shards_saving_path=split_dir, max_seq_len=2048)


def answer_one(model, tokenizer, job: Job, prompt_ids: list[int], choice_ids: list[int], eos_ids: set[int]) -> dict:
    ids = torch.tensor([prompt_ids], dtype=torch.long)
    with torch.inference_mode():
        if job.kind == "choice":
            logits = model(input_ids=ids, use_cache=False).logits[0, -1].float()
            scores = torch.log_softmax(logits, dim=-1)[choice_ids]
            return {"answer": job.choices[int(scores.argmax())], "output_tokens": 1}
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=job.max_new_tokens,
                             do_sample=False, use_cache=True, pad_token_id=tokenizer.pad_token_id)
    tokens = generated_tokens(out[0, ids.shape[1]:], eos_ids, job.max_new_tokens)
    return {"answer": tokenizer.decode(tokens, skip_special_tokens=True), "output_tokens": len(tokens)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("job")
    parser.add_argument("result")
    parser.add_argument("--split-dir", required=True)
    parser.add_argument("--prepare", action="store_true", help="only split the checkpoint into per-layer files")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    job = Job.read(args.job)
    model = open_model(job, args.split_dir)
    if args.prepare:
        return 0
    tokenizer = model.tokenizer
    eos = model.model.generation_config.eos_token_id
    eos_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    choice_ids = choice_token_ids(tokenizer, job.choices) if job.kind == "choice" else []
    clock = ForwardClock(model.model)
    read_before, answering = disk_read_bytes(), time.perf_counter()
    answers = [answer_one(model, tokenizer, job, ids, choice_ids, eos_ids)
               for ids in encode_prompts(tokenizer, job.prompts)]
    finished = time.perf_counter()
    RunnerResult(answers=answers, forward_seconds=clock.seconds, answer_seconds=finished - answering,
                 setup_seconds=answering - started, disk_read_bytes=disk_read_bytes() - read_before, batch_size=1,
                 notes=["streams embedding, layers, norm and head from its per-layer split files"]).write(args.result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
