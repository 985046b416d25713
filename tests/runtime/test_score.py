"""When a generation row stops: end-of-sequence, stop strings, the token limit."""
from types import SimpleNamespace

import pytest

from batchrun.runtime import GreedyPool
from batchrun.runtime.score import Sequence_, special_token_ids
from batchrun.spec import EncodedRow, Request

EOS, TURN = 0, 1


class CharTokenizer:
    """Token i is the character chr(i); tokens 0 (end-of-sequence) and 1 (a chat turn) are special: dropped from
    text, and spelled "</s>" and "<|im_start|>"."""
    all_special_tokens, all_special_ids = ["</s>", "<|im_start|>"], [EOS, TURN]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids if not (skip_special_tokens and i in self.all_special_ids))


def finish(text: str | list[int], stop=(), max_new_tokens=16, eos=False):
    request = Request(0, 0, "spec.jsonl:1", (("user", "q"),), "q", None, max_new_tokens, tuple(stop))
    tokens = [ord(c) for c in text] if isinstance(text, str) else text
    seq = Sequence_(EncodedRow(request, (1, 2), ()), generated=tokens + ([EOS] if eos else []))
    batch = SimpleNamespace(eos_ids={EOS}, tokenizer=CharTokenizer(), special_ids=special_token_ids(CharTokenizer()))
    GreedyPool._check_finished(batch, seq)
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


def test_a_stop_spelled_like_a_special_token_stops_at_that_token():
    # decoded text drops special tokens, so "<|im_start|>" can never be found in it: the token itself stops the row
    assert finish([ord("y"), ord("e"), ord("s"), TURN], stop=("<|im_start|>",)) == ("stop", "yes")
    assert finish([ord("y"), TURN, ord("s")], stop=("###",)) == (None, None)  # other special tokens run on


def test_added_tokens_marked_special_count_as_special_too():
    added = SimpleNamespace(content="<file_sep>", special=True)
    plain = SimpleNamespace(content="hello", special=False)
    tokenizer = SimpleNamespace(all_special_tokens=["</s>"], all_special_ids=[0],
                                added_tokens_decoder={7: added, 8: plain})
    assert special_token_ids(tokenizer) == {"</s>": 0, "<file_sep>": 7}
