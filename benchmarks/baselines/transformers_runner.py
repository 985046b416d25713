"""Baseline: plain transformers, either with accelerate disk offload or with the whole model resident.

    python -m benchmarks.baselines.transformers_runner JOB.json RESULT.json --mode offload|resident --batch-size N

offload: `from_pretrained(device_map=...)` with every decoder layer on "disk" (transformers 5.24 reads the original
safetensors in place; accelerate's hooks load each layer's weights before its forward, with no prefetch), the
embedding, final norm and head on the CPU. resident: an ordinary model in memory.

Both compute in the job's dtype (batchrun's own choice for the checkpoint on this machine), batch N prompts per
forward call (left padding), score choices with one forward (the last position's log-probabilities of each
single-token choice) and generate greedily.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from benchmarks.baselines.common import (ForwardClock, Job, RunnerResult, choice_token_ids, chunks, disk_read_bytes,
                                         encode_prompts, generated_tokens, left_pad)


def offload_device_map(checkpoint: str) -> dict[str, str]:
    """Every decoder layer on disk; what every pass needs besides them stays on the CPU."""
    config = AutoConfig.from_pretrained(checkpoint)
    device_map = {"model.embed_tokens": "cpu", "model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "cpu"}
    device_map.update({f"model.layers.{i}": "disk" for i in range(config.num_hidden_layers)})
    return device_map


def load_model(checkpoint: str, mode: str, offload_folder: str, dtype: torch.dtype):
    if mode == "offload":
        return AutoModelForCausalLM.from_pretrained(checkpoint, dtype=dtype,
                                                    device_map=offload_device_map(checkpoint),
                                                    offload_folder=offload_folder)
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=dtype)
    # transformers 5 may keep safetensors memory-mapped; touching every weight once makes it truly resident
    # (a bf16 checkpoint loaded as float32 is converted, hence copied, anyway; loaded as bfloat16 it may not be).
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.data = parameter.data.contiguous().clone()
    return model


def score(model, tokenizer, job: Job, batch_size: int) -> list[dict]:
    choice_ids = choice_token_ids(tokenizer, job.choices)
    answers = []
    for batch in chunks(encode_prompts(tokenizer, job.prompts), batch_size):
        ids, mask, positions = left_pad(batch, tokenizer.pad_token_id)
        with torch.inference_mode():
            logits = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False,
                           logits_to_keep=1).logits[:, -1].float()
        scores = torch.log_softmax(logits, dim=-1)[:, choice_ids]
        answers += [{"answer": job.choices[int(row.argmax())], "output_tokens": 1} for row in scores]
    return answers


def generate(model, tokenizer, job: Job, batch_size: int) -> list[dict]:
    eos = model.generation_config.eos_token_id
    eos_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    answers = []
    for batch in chunks(encode_prompts(tokenizer, job.prompts), batch_size):
        ids, mask, _ = left_pad(batch, tokenizer.pad_token_id)
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=job.max_new_tokens,
                                 do_sample=False, pad_token_id=tokenizer.pad_token_id)
        for row in out[:, ids.shape[1]:]:
            tokens = generated_tokens(row, eos_ids, job.max_new_tokens)
            answers.append({"answer": tokenizer.decode(tokens, skip_special_tokens=True),
                            "output_tokens": len(tokens)})
    return answers


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("job")
    parser.add_argument("result")
    parser.add_argument("--mode", choices=["offload", "resident"], required=True)
    parser.add_argument("--batch-size", type=int, required=True)
    args = parser.parse_args(argv)
    started = time.perf_counter()
    job = Job.read(args.job)
    with tempfile.TemporaryDirectory(prefix="offload-") as offload_folder:
        model = load_model(job.checkpoint, args.mode, offload_folder, getattr(torch, job.dtype))
        model.eval()
        tokenizer = AutoTokenizer.from_pretrained(job.checkpoint)
        clock = ForwardClock(model)
        read_before, answering = disk_read_bytes(), time.perf_counter()
        run = score if job.kind == "choice" else generate
        answers = run(model, tokenizer, job, args.batch_size)
        finished = time.perf_counter()
        notes = []
        if args.mode == "offload":
            import os

            written = sum(len(files) for _, _, files in os.walk(offload_folder))
            notes.append(f"offload folder held {written} files (0: weights read in place from the checkpoint)")
        RunnerResult(answers=answers, forward_seconds=clock.seconds, answer_seconds=finished - answering,
                     setup_seconds=answering - started, disk_read_bytes=disk_read_bytes() - read_before,
                     batch_size=args.batch_size, notes=notes).write(args.result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
