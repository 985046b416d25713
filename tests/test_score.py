"""When a generation row stops: end-of-sequence, stop strings, the token limit."""
from types import SimpleNamespace

import pytest

from batchrun.prompts import EncodedRow
from batchrun.score import GreedyBatch, Sequence_
from batchrun.spec import Request

EOS = 0


class CharTokenizer:
    """Token i is the character chr(i); token 0 is end-of-sequence (a special token, dropped from text)."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids if not (skip_special_tokens and i == EOS))


def finish(text: str, stop=(), max_new_tokens=16, eos=False):
    request = Request(0, 0, "spec.jsonl:1", (("user", "q"),), "q", None, max_new_tokens, tuple(stop))
    seq = Sequence_(EncodedRow(request, (1, 2), ()), generated=[ord(c) for c in text] + ([EOS] if eos else []))
    batch = SimpleNamespace(eos_ids={EOS}, tokenizer=CharTokenizer())
    GreedyBatch._check_finished(batch, seq)
    return seq.finish, seq.text


def test_earliest_stop_wins_whatever_the_list_order():
    # One token can complete two stops at once (BPE has tokens like ".\n"): the answer ends at the earlier one.
    assert finish("Hello.\n", stop=("\n", ".")) == ("stop", "Hello")
    assert finish("Hello.\n", stop=(".", "\n")) == ("stop", "Hello")


@pytest.mark.parametrize("text, stop, expected", [
    ("Yes, because", (",",), ("stop", "Yes")),
    ("no stop here", ("###",), (None, None)),  # still running: under the limit, no stop, no end-of-sequence
])
def test_stop_strings(text, stop, expected):
    assert finish(text, stop=stop) == expected


def test_end_of_sequence_and_limit():
    assert finish("done", eos=True) == ("stop", "done")
    assert finish("abcd", max_new_tokens=4) == ("length", "abcd")
