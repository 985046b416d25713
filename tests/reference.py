"""Expected values from plain transformers, computed in memory and independently of batchrun's model handles.

batchrun's prefill, decode and shared-prefix code is what the tests check; their expected numbers come from
`AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)` over one whole, unpadded sequence, with no
cache, so a fault in the streamed or resident forward cannot cancel out.
"""
from __future__ import annotations

import functools
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

# Float32 on both sides: only the order of floating-point operations differs (batching, padding, a prefix computed
# once, a cache), a few ulps of the logits.
TOLERANCE = 1e-4


def sequences(vocab: int, shared: int = 24, count: int = 5) -> list[list[int]]:
    """`count` token sequences of 4, 7, 10... own tokens after one common head of `shared` tokens."""
    generator = torch.Generator().manual_seed(7)
    head = torch.randint(3, vocab, (shared,), generator=generator).tolist()
    return [head + torch.randint(3, vocab, (4 + 3 * i,), generator=generator).tolist() for i in range(count)]


def _signature(checkpoint: Path) -> tuple:
    """What a cached reference model was loaded from: the path and its files' sizes and times, so a checkpoint
    rewritten in place (a test's edited copy at a reused path) loads again."""
    return tuple(sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in checkpoint.iterdir() if p.is_file()))


@functools.lru_cache(maxsize=4)
def _load(checkpoint: str, signature: tuple):
    # Eager attention: batchrun replaces transformers' sdpa function process-wide (prefix_attention.install), and
    # the reference must not run through anything batchrun installs.
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32, attn_implementation="eager")
    return model.eval()


def reference_model(checkpoint) -> torch.nn.Module:
    """The plain transformers float32 model of `checkpoint`, loaded once per checkpoint (read only, never edited)."""
    checkpoint = Path(checkpoint).resolve()
    return _load(str(checkpoint), _signature(checkpoint))


def reference_logprobs(checkpoint, seq: list[int], keep: int) -> torch.Tensor:
    """[keep, vocab]: plain transformers' log-probs at the last `keep` positions of `seq`, one sequence alone."""
    model = reference_model(checkpoint)
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([seq]), use_cache=False).logits[0, -keep:]
    return torch.log_softmax(logits.float(), -1)


def assert_matches_reference(got: torch.Tensor, checkpoint, seq: list[int], keep: int = 1) -> None:
    """`got` ([keep, vocab] or [vocab] for keep 1) equals plain transformers' log-probs over `seq` to TOLERANCE."""
    expected = reference_logprobs(checkpoint, seq, keep)
    if got.dim() == 1:
        expected = expected[-1]
    difference = (got.float() - expected).abs().max().item()
    assert difference <= TOLERANCE, f"{difference:.3g} from plain transformers over {len(seq)} tokens"


def decode_matching_reference(handle, states, got, seqs: list[list[int]], checkpoint, steps: int) -> None:
    """Greedy-decode `steps` tokens from the prefilled `states` (`got`: the prefill's log-probs), checking every step's
    log-probs against the plain model run on the sequence so far."""
    from batchrun.runtime.decode import decode

    tokens = {i: int(lp[-1].argmax()) for i, lp in enumerate(got)}
    for _ in range(steps):
        stepped = decode(handle, states, tokens)
        for i in tokens:
            seqs[i] = seqs[i] + [tokens[i]]
            assert_matches_reference(stepped[i], checkpoint, seqs[i])
        tokens = {i: int(lp.argmax()) for i, lp in stepped.items()}
