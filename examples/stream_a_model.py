"""The low-level runtime: stream the default model's decoder layers from disk while it generates.

StreamedModel keeps embeddings, final norm and head resident and reads each decoder layer from the
checkpoint's file (the default model's GGUF here) just before it runs, so only a layer or two are ever in memory
at once.
"""
from __future__ import annotations

import time

import batchrun

QUESTION = "Name three fruits that are yellow."


def main() -> None:
    checkpoint = batchrun.default_model()  # SmolLM2-135M-Instruct's GGUF, kept once in the state directory
    with batchrun.StreamedModel(checkpoint, dtype="float32") as sm:
        messages = [{"role": "user", "content": QUESTION}]
        # Render the template to text first, then tokenize: this works the same on every transformers version.
        text = sm.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        encoded = sm.tokenizer(text, return_tensors="pt", add_special_tokens=False)
        input_ids = encoded["input_ids"].to(sm.device)
        attention_mask = encoded["attention_mask"].to(sm.device)

        started = time.monotonic()
        output_ids = sm.generate(input_ids, attention_mask=attention_mask, max_new_tokens=20, do_sample=False)
        seconds = time.monotonic() - started

        new_tokens = output_ids[0, input_ids.shape[1]:]
        print(f"prompt: {QUESTION}")
        print(f"answer: {sm.tokenizer.decode(new_tokens, skip_special_tokens=True).strip()}")
        print(f"{len(new_tokens)} new tokens in {seconds:.1f} s over {sm.passes} passes through the "
              f"{sm.num_layers} decoder layers; at most {sm.peak_materialised_layers} layers were in memory at once")


if __name__ == "__main__":
    main()
