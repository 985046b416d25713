"""One row of a spec as the request it runs, in any of the three shapes (read.py): a native row, an OpenAI Batch API
line, or a corpus row filled into the template; its messages, its answer settings (choices, or a limit and stop
strings) and the values it carries to the output. No torch."""
from __future__ import annotations

import json
from collections.abc import Sequence
from typing import NamedTuple
from dataclasses import dataclass, replace
from pathlib import Path

from batchrun.spec.files import kind, show
from batchrun.spec.structure import (Structure, json_schema_structure, regex_structure, response_format_structure,
                                     structured_label)
from batchrun.spec.pairs import (ORDERS, PairOrder, checked_pair_choices, corpus_orders, corpus_pair, native_orders,
                                 native_pair, order_label, pair_label)
from batchrun.spec.template import Field, RowProblem, render_template, template_columns
from batchrun.spec.values import (checked_choices, checked_label, checked_stop, checked_text, positive_int,
                                  refuse_unknown_keys)
from batchrun.spec.verdicts import Verdict, rationale_stops

NATIVE_KEYS = ("id", "custom_id", "prompt", "messages", "system", "choices", "max_new_tokens", "stop", "label",
               "metadata", "continue_final_message", "a", "b", "then", "json_schema", "regex")
# label and metadata are batchrun's own, beside an OpenAI line's keys: the expected answer and the user's data.
OPENAI_KEYS = ("custom_id", "method", "url", "body", "label", "metadata")
OPENAI_CHAT_URL = "/v1/chat/completions"
# The chat-completions parameters batchrun reads (tools only to refuse them) and those it ignores: sampling, logging,
# caching and streaming say nothing a greedy, text-only run of one answer a request could honour.
# continue_final_message is vLLM's extension of the same request, read as a native row's.
BODY_READ_KEYS = ("messages", "max_tokens", "max_completion_tokens", "stop", "n", "tools", "functions", "tool_choice",
                  "function_call", "web_search_options", "continue_final_message", "response_format")
BODY_IGNORED_KEYS = ("model", "temperature", "top_p", "seed", "presence_penalty",
                     "frequency_penalty", "logit_bias", "logprobs", "top_logprobs", "user", "metadata", "store",
                     "service_tier", "stream", "stream_options", "parallel_tool_calls", "reasoning_effort", "verbosity",
                     "prediction", "modalities", "audio", "prompt_cache_key", "prompt_cache_retention",
                     "safety_identifier")
ROLES = ("system", "user", "assistant")
MESSAGE_KEYS = ("role", "content", "name")  # an OpenAI message's name is accepted and not sent: templates have no slot


@dataclass(frozen=True, slots=True)
class Request:
    # 0-based position among the requests of all rows of the file (valid and invalid), in input order; a pair row's
    # second order comes right after its first
    index: int
    id: str | int
    location: str  # "jobs/x.jsonl:12" or "data.parquet: row 3", for messages
    messages: tuple[tuple[str, str], ...]  # (role, content); a system message, if any, comes first
    prompt: str | None  # raw prompt text of prompt/template rows; None for messages rows
    choices: tuple[str, ...] | None  # set for classification rows
    max_new_tokens: int  # 0 for choice rows
    stop: tuple[str, ...]
    label: str | None = None  # the expected answer: one of the choices, or the text a generation row should give
    carried: dict | None = None  # output column -> value the row carries through (metadata, --keep-columns)
    # The final assistant message is the start of the answer, continued in its own turn (vLLM's
    # continue_final_message), not followed by a new turn.
    continue_final: bool = False
    pair: PairOrder | None = None  # set on the two requests of a pair row (spec/pairs.py)
    structure: Structure | None = None  # the JSON Schema or pattern its answer must match (spec/structure.py)
    # A row that writes its reasons before its verdict (spec/verdicts.py): its first stage generates the rationale
    # (max_new_tokens, stop), then `verdict` says what is scored after it.
    verdict: Verdict | None = None
    answer_start: str = ""  # text written after the rendered prompt, where the answer begins (a verdict's rationale)

    @property
    def pair_group(self) -> int | None:
        """The index of its pair row's first order, shared by both orders (None for other rows): the two orders'
        prompts start alike up to the first answer, which a pass computes once for both."""
        if self.pair is None:
            return None
        return self.index if self.pair.order == "ab" else self.index - 1

    @property
    def scored_choices(self) -> tuple[str, ...] | None:
        """The choices the row's answer is one of: its own, or those its verdict scores after a rationale."""
        return self.verdict.choices if self.verdict is not None else self.choices


@dataclass(frozen=True)
class JobSettings:
    """SpecSettings checked: the job-level settings every row falls back on, plus corpus-mode settings."""

    choices: tuple[str, ...] | None
    system: str | None
    max_new_tokens: int
    stop: tuple[str, ...]
    template: list[str | Field] | None
    id_column: str | None
    row_settings: tuple[str, ...]  # the corpus columns that are a row's settings, not data
    label_column: str | None = None  # corpus mode: the column holding each row's expected answer
    keep_columns: tuple[str, ...] | None = None  # corpus mode: input columns copied to the output; ("*",): all
    pair_columns: tuple[str, str] | None = None  # corpus mode: the two answers each row's pair judges
    then: str | None = None  # the cue before a choice row's verdict, after a rationale it writes first
    structure: Structure | None = None  # corpus mode: the JSON Schema every row's answer must match (--json-schema)
    base_dir: Path | None = None  # the spec's folder: a row's json_schema path is read from there


def row_requests(row: dict, index: int, row_id: str | int, location: str, job: JobSettings) -> list[Request]:
    """The requests a row runs as: itself, or a pair row's two orders (indices `index` and `index + 1`)."""
    if job.pair_columns is not None:
        answers = corpus_pair(row, job.pair_columns)
        label = pair_label(row.get(job.label_column), f"label (column {job.label_column!r})") \
            if job.label_column is not None else None
        orders = corpus_orders(row, job.pair_columns, job.label_column)
    else:
        answers = native_pair(row) if job.template is None else None  # a corpus row's a and b are plain columns
        if answers is None:
            return [row_request(row, index, row_id, location, job)]
        label, orders = pair_label(row.get("label")), native_orders(row, answers)
    made = []
    for offset, (order, order_row) in enumerate(zip(ORDERS, orders)):
        request = row_request(order_row, index + offset, row_id, location, job)
        if request.verdict is not None:
            raise RowProblem("a pair row scores its two orders' verdicts directly; then (reasons before the verdict) "
                             "applies to other choice rows")
        choices = checked_pair_choices(request.choices, request.max_new_tokens)
        made.append(replace(request, label=order_label(label, order, choices),
                            pair=PairOrder(order, len(answers[0]), len(answers[1]), label)))
    return made


def row_request(row: dict, index: int, row_id: str | int, location: str, job: JobSettings) -> Request:
    """The row as it runs, with the label and the values it carries to the output."""
    request = _with_structure(_request_shape(row, index, row_id, location, job), _structure_of(row, job))
    if job.template is not None:
        label = row.get(job.label_column) if job.label_column is not None else None
        carried = _kept_columns(row, job)
    else:
        label, carried = row.get("label"), _metadata(row.get("metadata"))
    if label is None and carried is None:
        return request
    if request.structure is not None and request.structure.is_json:  # a JSON value, judged field by field
        return replace(request, label=structured_label(label, job.label_column), carried=carried)
    return replace(request, label=checked_label(label, request.scored_choices, job.label_column), carried=carried)


def _structure_of(row: dict, job: JobSettings) -> Structure | None:
    """The structure the row's answer must take: corpus mode's --json-schema, an OpenAI body's response_format or a
    native row's json_schema or regex (the row's shape is checked before this)."""
    if job.template is not None:
        return job.structure
    if any(row.get(key) is not None for key in ("body", "url", "method")):
        form = row["body"].get("response_format")
        return response_format_structure(form) if form is not None else None
    schema, pattern = row.get("json_schema"), row.get("regex")
    if schema is not None and pattern is not None:
        raise RowProblem("a row has either json_schema or regex, not both")
    if schema is not None:
        return json_schema_structure(schema, "json_schema", job.base_dir)
    return regex_structure(pattern) if pattern is not None else None


def _with_structure(request: Request, structure: Structure | None) -> Request:
    if structure is None:
        return request
    if request.scored_choices is not None:
        raise RowProblem("a choice row answers with one of its choices; it cannot also ask for a json_schema, "
                         "regex or response_format (drop one)")
    return replace(request, structure=structure)


def _metadata(value: object) -> dict | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise RowProblem(f"metadata must be a JSON object, got {kind(value)}")
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError) as error:
        raise RowProblem(f"metadata cannot be written as JSON: {error}") from None
    return {"metadata": value}


def _kept_columns(row: dict, job: JobSettings) -> dict | None:
    if job.keep_columns is None:
        return None
    names = list(row) if job.keep_columns == ("*",) else job.keep_columns
    missing = [name for name in names if name not in row]
    if missing:
        raise RowProblem(f"--keep-columns names {', '.join(map(repr, missing))}, which this row does not have")
    return _cells(row, names)


def kept_columns_of_failed_row(row: object, job: JobSettings) -> dict | None:
    """The kept columns a refused corpus row still has (one it lacks stays empty): the output names the row by
    them beside its error."""
    if not isinstance(row, dict) or job.template is None or job.keep_columns is None:
        return None
    return _cells(row, list(row) if job.keep_columns == ("*",) else job.keep_columns)


def _cells(row: dict, names: Sequence[str]) -> dict:
    # JSON text for what a Parquet/JSON cell can hold beyond numbers and text (dates, decimals, bytes)
    return {name: json.loads(json.dumps(row.get(name), default=str)) for name in names}


def _request_shape(row: dict, index: int, row_id: str | int, location: str, job: JobSettings) -> Request:
    if job.template is not None:
        prompt = checked_text(render_template(job.template, _as_template_values(row, job.template)),
                              "the filled-in template", allow_empty=False)
        own = {key: row.get(key) for key in job.row_settings}
        answer = _answer(own.get("choices"), own.get("max_new_tokens"), own.get("stop"), job, own.get("then"))
        return _prompt_request(index, row_id, location, prompt, _row_system(own.get("system"), job), answer)
    if any(row.get(key) is not None for key in ("body", "url", "method")):
        return _openai_request(row, index, row_id, location, job)
    refuse_unknown_keys(row, NATIVE_KEYS, "")
    prompt, messages = row.get("prompt"), row.get("messages")
    if prompt is not None and messages is not None:
        raise RowProblem("a row has either prompt or messages, not both")
    if prompt is None and messages is None:
        raise RowProblem("missing prompt (or messages)")
    answer = _answer(row.get("choices"), row.get("max_new_tokens"), row.get("stop"), job, row.get("then"))
    system = row.get("system")
    if prompt is not None:
        prompt = checked_text(prompt, "prompt", allow_empty=False)
        return _continued(_prompt_request(index, row_id, location, prompt, _row_system(system, job), answer),
                          row.get("continue_final_message"), "continue_final_message")
    if system is not None:
        raise RowProblem("system applies to prompt rows; put a system message first in messages instead")
    pairs = _messages(messages, "messages", job.system)
    return _continued(_request(index, row_id, location, pairs, None, answer), row.get("continue_final_message"),
                      "continue_final_message")


def _continued(request: Request, value: object, what: str) -> Request:
    """The request continuing its final assistant message where the row asks (`value` true)."""
    if value is None or value is False:
        return request
    if value is not True:
        raise RowProblem(f"{what} must be true or false, got {kind(value)}")
    if request.messages[-1][0] != "assistant":
        raise RowProblem(f"{what} continues a final assistant message, and this row's last message is "
                         f"{request.messages[-1][0]!r}")
    return replace(request, continue_final=True)


def _row_system(system: object, job: JobSettings) -> str | None:
    """A prompt row's system message: its own, else the job's; an explicit empty string opts out of the job's."""
    return job.system if system is None else checked_text(system, "system", allow_empty=True)


def _as_template_values(row: dict, template: list[str | Field]) -> dict:
    """Nested values and booleans as JSON text (["a", "b"], {"k": 1}, false): str() would write Python's spelling
    (['a', 'b'], False), which a prompt should not show. Text and numbers are left as they are."""
    nested = {name: row[name] for name in template_columns(template) if isinstance(row.get(name), (bool, list, dict))}
    # default=str: Parquet dates and decimals inside a struct are written as their text.
    return {**row, **{name: json.dumps(value, ensure_ascii=False, default=str) for name, value in nested.items()}}


def _prompt_request(index, row_id, location, prompt: str, system: str | None, answer) -> Request:
    pairs = ((("system", system),) if system else ()) + (("user", prompt),)
    return _request(index, row_id, location, pairs, prompt, answer)


def _request(index, row_id, location, messages, prompt: str | None, answer: _Answer) -> Request:
    return Request(index, row_id, location, messages, prompt, answer.choices, answer.max_new_tokens, answer.stop,
                   verdict=answer.verdict)


def _openai_request(row: dict, index: int, row_id: str | int, location: str, job: JobSettings) -> Request:
    """An OpenAI Batch API line; the body's sampling parameters (BODY_IGNORED_KEYS) are ignored, others refused."""
    refuse_unknown_keys(row, OPENAI_KEYS, " in an OpenAI batch line")
    method, url, body = row.get("method"), row.get("url"), row.get("body")
    if method is not None and method != "POST":
        raise RowProblem(f"method {show(method)} is not supported; OpenAI batch lines use POST")
    if url != OPENAI_CHAT_URL:
        raise RowProblem(f"url {show(url)} is not supported; batchrun runs {OPENAI_CHAT_URL} requests only")
    if not isinstance(body, dict):
        raise RowProblem(f"body must be an object, got {kind(body)}")
    refuse_unknown_keys(body, BODY_READ_KEYS + BODY_IGNORED_KEYS, " in body",
                         otherwise=f"not a {OPENAI_CHAT_URL} parameter")
    _refuse_tool_use(body)
    count = body.get("n")
    if count is not None and (isinstance(count, bool) or count != 1):
        raise RowProblem(f"body.n is {show(count)}; batchrun writes exactly one answer per request")
    if body.get("messages") is None:
        raise RowProblem("body.messages is missing")
    limit, completion_limit = body.get("max_tokens"), body.get("max_completion_tokens")
    if limit is not None and completion_limit is not None and limit != completion_limit:
        raise RowProblem("body.max_tokens and body.max_completion_tokens differ; give one of them")
    limit_name = "body.max_tokens" if limit is not None else "body.max_completion_tokens"
    limit = completion_limit if limit is None else limit
    messages = _messages(body["messages"], "body.messages", job.system, developer_is_system=True)
    answer = _answer(None, limit, body.get("stop"), job, limit_name=limit_name, stop_name="body.stop")
    return _continued(_request(index, row_id, location, messages, None, answer), body.get("continue_final_message"),
                      "body.continue_final_message")


def _refuse_tool_use(body: dict) -> None:
    """batchrun runs text in, text out: a request that needs a tool call or a web search cannot be answered."""
    for key in ("tools", "functions"):
        if body.get(key):  # an empty list offers no tool
            raise RowProblem(f"body.{key} asks for tools; batchrun cannot call tools (it answers with text only)")
    for key in ("tool_choice", "function_call"):
        if _forces_a_tool(body.get(key)):
            raise RowProblem(f"body.{key} {show(body[key])} forces a tool call; batchrun cannot call tools")
    if body.get("web_search_options") is not None:  # even {}: it turns the search on with its defaults
        raise RowProblem("body.web_search_options asks for a web search; batchrun cannot search the web")


def _forces_a_tool(choice: object) -> bool:
    if choice in (None, "none", "auto"):
        return False
    if isinstance(choice, dict) and choice.get("type") == "allowed_tools":
        allowed = choice.get("allowed_tools")
        return not (isinstance(allowed, dict) and allowed.get("mode") == "auto")
    return True  # "required", a named tool, or a value OpenAI would refuse


class _Answer(NamedTuple):
    choices: tuple[str, ...] | None
    max_new_tokens: int
    stop: tuple[str, ...]
    verdict: Verdict | None = None


def _answer(choices, max_new_tokens, stop, job: JobSettings, then=None, limit_name="max_new_tokens",
            stop_name="stop") -> _Answer:
    """What the row answers with. A row's own settings win over the job's; a row giving both choices and
    generation settings is contradictory, unless it writes a rationale before its verdict (`then`: the cue before
    the choices), where max_new_tokens and stop are the rationale's."""
    generation = max_new_tokens is not None or stop is not None
    cue = job.then if then is None else checked_text(then, "then", allow_empty=False)
    if cue is not None and (choices is not None or job.choices is not None):
        scored = checked_choices(choices, "choices") if choices is not None else job.choices
        limit = job.max_new_tokens if max_new_tokens is None else positive_int(max_new_tokens, limit_name)
        stops = job.stop if stop is None else checked_stop(stop, stop_name)
        return _Answer(None, limit, rationale_stops(stops, cue), Verdict(cue, scored))
    if then is not None:
        raise RowProblem("then is the cue before a verdict among the row's choices, and this row has no choices")
    if choices is not None:
        if generation:
            raise RowProblem("a row is either a choice row (choices) or a generation row "
                             "(max_new_tokens/stop), not both; a row that writes its reasons before choosing "
                             "gives the cue before its verdict as then")
        return _Answer(checked_choices(choices, "choices"), 0, ())
    if job.choices is not None and not generation:
        return _Answer(job.choices, 0, ())
    limit = job.max_new_tokens if max_new_tokens is None else positive_int(max_new_tokens, limit_name)
    return _Answer(None, limit, job.stop if stop is None else checked_stop(stop, stop_name))


def _messages(value: object, what: str, default_system: str | None, developer_is_system: bool = False):
    if not isinstance(value, list):
        raise RowProblem(f"{what} must be a list of {{role, content}} objects, got {kind(value)}")
    if not value:
        raise RowProblem(f"{what} is empty")
    pairs = []
    for position, message in enumerate(value):
        where = f"{what}[{position}]"
        if not isinstance(message, dict):
            raise RowProblem(f"{where} must be an object with role and content, got {kind(message)}")
        refuse_unknown_keys(message, MESSAGE_KEYS, f" in {where}")
        role, content = message.get("role"), message.get("content")
        if message.get("name") is not None:
            checked_text(message["name"], f"{where}.name", allow_empty=True)
        if developer_is_system and role == "developer":  # OpenAI's newer name for the system role
            role = "system"
        if role not in ROLES:
            got = "missing" if role is None else show(role)
            raise RowProblem(f"{where}.role is {got}; use one of {', '.join(ROLES)}")
        if role == "system" and position > 0:
            raise RowProblem(f"{where}: a system message may only come first")
        if content is None:
            raise RowProblem(f"{where}.content is missing")
        if isinstance(content, list):  # OpenAI content parts
            content = _text_parts(content, f"{where}.content")
        pairs.append((role, checked_text(content, f"{where}.content", allow_empty=True)))
    if default_system and pairs[0][0] != "system":
        pairs.insert(0, ("system", default_system))
    return tuple(pairs)


def _text_parts(parts: list, what: str) -> str:
    """OpenAI content parts [{"type": "text", "text": ...}], one line each; the models here read text only."""
    texts = []
    for position, part in enumerate(parts):
        if not isinstance(part, dict):
            raise RowProblem(f"{what}[{position}] must be a content part object, got {kind(part)}")
        if "type" not in part:
            raise RowProblem(f"{what}[{position}] has no type; a text part is {{\"type\": \"text\", \"text\": ...}}")
        if part["type"] != "text":
            raise RowProblem(f"{what}[{position}] is a {show(part['type'])} part; only text parts can be sent "
                             "to a text model")
        texts.append(checked_text(part.get("text"), f"{what}[{position}].text", allow_empty=True))
    return "\n".join(text for text in texts if text)
