"""What a user asks of a job besides its spec: the options `plan` and `submit` share, checked as the CLI checks
them so that scripts building options get the same refusals.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace

from batchrun.errors import SettingRefused
from batchrun.plan import TOKEN_MATRIX_CHOICES, parse_streaming
from batchrun.spec import TRUNCATE_SIDES

# Settings that can change answers, recorded with a job. Its identity is what they do to its rows (fingerprint):
# batch size, memory budget, streaming policy and prefetch change no row, so a job resumes whatever they are.
ANSWER_SETTINGS = ("template", "id_column", "choices", "system", "max_new_tokens", "stop", "raw", "dtype",
                   "label_column", "keep_columns", "calibrate", "truncate", "pair_columns", "then",
                   "json_schema")
CALIBRATION_METHODS = ("auto", "none", "batch", "content-free", "labels")
DEFAULT_CALIBRATION = "auto"  # changes answers only where labelled rows show it helps (docs/calibration.md)
# A crash, a kill or a power cut costs the pass in flight: passes are planned to last at most this long.
DEFAULT_PASS_MINUTES = 10.0


@dataclass
class JobOptions:
    """A job's options besides its spec, as `batchrun submit` and `batchrun plan` take them (docs/cli.md): `model`
    (a checkpoint directory or hub id; None: the default model), the settings rows fall back on (`choices`,
    `system`, `max_new_tokens`, `stop`), corpus mode (`template`, `id_column`) and resources (`device`, `dtype`,
    `batch_size`, `memory_gb`, `streaming`, ...). Refuses a value the CLI would refuse, with SettingRefused.

    >>> import batchrun
    >>> options = batchrun.JobOptions(max_new_tokens=4, stop=("\\n",))
    >>> answers = batchrun.submit([{"id": "q1", "prompt": "Name a fruit."}], options=options)
    >>> answers["output_tokens"][0].as_py() <= 4
    True
    """

    model: str | None = None
    template: str | None = None
    id_column: str | None = None
    choices: tuple[str, ...] | None = None
    system: str | None = None
    max_new_tokens: int = 16
    stop: tuple[str, ...] | None = None
    raw: bool = False
    dtype: str | None = None
    skip_invalid: bool = False
    device: str | None = None
    batch_size: int | None = None
    memory_gb: float | None = None
    streaming: str | None = None
    prefetch: bool = True
    prefetch_depth: int = 1  # layers read ahead of the one computing
    micro_batch: int | None = None  # sequences per forward call within a pass (default: the plan's)
    bandwidth_gbps: float | None = None
    hf_token: str | None = field(default=None, repr=False)
    trust_remote_code: bool = False
    label_column: str | None = None  # corpus mode: the column holding each row's expected answer
    keep_columns: tuple[str, ...] | None = None  # corpus mode: input columns copied into the output; ("*",): all
    pair_columns: tuple[str, str] | None = None  # corpus mode: the two answers each row's pair judges, in both orders
    then: str | None = None  # choice rows write a rationale first, then their verdict is scored after this cue
    json_schema: str | None = None  # corpus mode: the file of the JSON Schema every answer must match
    calibrate: str = DEFAULT_CALIBRATION  # how choice probabilities are calibrated (docs/calibration.md)
    pass_minutes: float | None = DEFAULT_PASS_MINUTES  # the longest a pass is planned to take; None: no bound
    truncate: str | None = None  # "head" | "tail": cut an over-long row's document from that end; None: refuse it
    # where a streamed run keeps the embedding and head: auto (the plan weighs them), held, gathered, streamed
    token_matrices: str = "auto"

    def __post_init__(self):
        """The checks the CLI's option types make, for scripts that build options themselves."""
        if self.dtype not in (None, "auto", "float32", "bfloat16", "float16"):
            raise SettingRefused(f"dtype {self.dtype!r}: use float32, bfloat16 or float16 (or None: the device's)")
        for name in ("batch_size", "micro_batch", "prefetch_depth", "max_new_tokens"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise SettingRefused(f"{name} must be a positive integer, got {value!r}")
        for name in ("memory_gb", "bandwidth_gbps", "pass_minutes"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, (int, float)) and 0 < value < math.inf):
                raise SettingRefused(f"{name} must be a positive finite number, got {value!r}")
        if self.truncate not in (None, *TRUNCATE_SIDES):
            raise SettingRefused(f"truncate {self.truncate!r}: use head or tail (or None: refuse a row over the "
                                 "context)")
        if self.token_matrices not in TOKEN_MATRIX_CHOICES:
            raise SettingRefused(f"token_matrices {self.token_matrices!r}: use one of "
                                 f"{', '.join(TOKEN_MATRIX_CHOICES)}")
        if self.calibrate not in CALIBRATION_METHODS:
            raise SettingRefused(f"calibrate {self.calibrate!r}: use one of {', '.join(CALIBRATION_METHODS)}")
        if isinstance(self.keep_columns, str):
            self.keep_columns = tuple(name.strip() for name in self.keep_columns.split(",") if name.strip())
        if isinstance(self.pair_columns, str):
            self.pair_columns = tuple(name.strip() for name in self.pair_columns.split(","))
        if self.streaming is not None:
            try:
                parse_streaming(self.streaming)
            except ValueError as error:
                raise SettingRefused(str(error)) from None

    def with_effective_calibration(self, requests) -> JobOptions:
        """Auto calibration weighs methods on labelled choice rows; without any, it is none, and the job is the one
        it would be without calibration (the same identity, the same recorded settings)."""
        if self.calibrate == "auto" and not any(r.scored_choices is not None and r.label is not None
                                                for r in requests):
            return replace(self, calibrate="none")
        return self

    def answer_settings(self) -> dict:
        values = asdict(self)
        return {k: (list(values[k]) if isinstance(values[k], tuple) else values[k]) for k in ANSWER_SETTINGS}
