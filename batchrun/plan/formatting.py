"""People-readable numbers and tables for plans (used by the CLI and in plan messages). No torch."""
from __future__ import annotations

from typing import Iterable, Mapping

from batchrun.host import disk_free_bytes, state_dir


def format_bytes(count: float | None) -> str:
    """Binary units with about three significant digits: "512 B", "1.25 GiB", "131 GiB"."""
    if count is None:
        return "unknown"
    value = float(count)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            break
        value /= 1024
    if unit == "B":
        return f"{int(value)} B"
    decimals = 2 if abs(value) < 10 else 1 if abs(value) < 100 else 0
    return f"{value:.{decimals}f} {unit}"


def format_rate(bytes_per_s: float | None) -> str:
    """Disk bandwidth in decimal GB/s or MB/s, the way drives are sold and benchmarked."""
    if bytes_per_s is None:
        return "unknown"
    if bytes_per_s >= 1e9:
        return f"{bytes_per_s / 1e9:.2f} GB/s"
    return f"{bytes_per_s / 1e6:.0f} MB/s"


def format_duration(seconds: float | None) -> str:
    """How a person says it: "35 ms", "2.5 s", "42 s", "3 min", "3.4 h", "2.3 days"."""
    if seconds is None:
        return "unknown"
    if seconds <= 0:
        return "0 s"
    if seconds < 0.95:  # a tiny model's pass: "0.0 s" would say nothing
        milliseconds = seconds * 1000
        return f"{milliseconds:.2g} ms" if milliseconds < 10 else f"{round(milliseconds)} ms"
    if seconds < 10:
        return f"{seconds:.1f} s"
    if seconds < 60:
        return f"{round(seconds)} s"
    if seconds < 3600:
        return f"{round(seconds / 60)} min"
    if seconds < 48 * 3600:
        return f"{seconds / 3600:.1f} h"
    days = seconds / 86400
    return f"{days:.1f} days" if days < 100 else f"{round(days)} days"


def format_plan_table(report: Mapping) -> str:
    """One plan as an aligned two-column table with its blockers and caveats. Takes a candidate
    (Candidate.to_json()) or a plan report holding "candidates" (then the job summary comes first)."""
    if "candidates" in report:
        parts = [_job_summary(report)] + [_candidate_table(c) for c in report["candidates"]]
        return "\n\n".join(part for part in parts if part)
    return _candidate_table(report)


def format_comparison(candidates: Iterable | Mapping) -> str:
    """Several plans side by side (mode, peak memory, passes, ETA, disk needed), then each one's blockers and
    caveats. Takes candidates (Candidate objects or their JSON) or a plan report holding "candidates"."""
    summary = ""
    if isinstance(candidates, Mapping):
        summary, candidates = _job_summary(candidates), candidates["candidates"]
    reports = [c.to_json() if hasattr(c, "to_json") else c for c in candidates]
    headers = _column_headers(reports)
    rows = [
        ("mode", [_mode(r) for r in reports]),
        ("fits", ["yes" if r.get("fits") else "NO" for r in reports]),
        ("peak memory", [format_bytes(r.get("peak_memory_bytes")) for r in reports]),
        ("budget", [format_bytes(r.get("memory_budget_bytes")) for r in reports]),
        ("batch", [f"{r['batch_size']} seq" if r.get("batch_size") else "-" for r in reports]),
        ("passes", [str(r.get("passes", "-")) for r in reports]),
        ("per pass", [format_duration(r.get("seconds_per_pass")) for r in reports]),
        ("ETA", [format_duration(r.get("eta_seconds")) for r in reports]),
        ("answers/hour", [_per_hour(r.get("answers_per_hour")) for r in reports]),
        ("disk needed", [format_bytes(r.get("disk_needed_bytes")) for r in reports]),
    ]
    label_width = max(len(label) for label, _ in rows)
    widths = [max(len(h), *(len(values[i]) for _, values in rows)) for i, h in enumerate(headers)]
    text = ["  ".join([" " * label_width] + [h.ljust(w) for h, w in zip(headers, widths)]).rstrip()]
    for label, values in rows:
        text.append("  ".join([label.ljust(label_width)] + [v.ljust(w) for v, w in zip(values, widths)]).rstrip())
    for header, report in zip(headers, reports):
        text += _listed(f"{header} blockers", report.get("blockers", []))
        text += _listed(f"{header} caveats", report.get("caveats", []))
    return "\n".join(([summary, ""] if summary else []) + text)


def _candidate_table(report: Mapping) -> str:
    if report.get("mode") is None:  # a model that could not be planned at all
        return "\n".join([f"model  {report['model']}: {report.get('reason', 'cannot be planned')}"]
                         + _listed("blockers", report.get("blockers", [])))
    lines = [
        ("model", report["model"]),
        ("mode", f"{_mode(report)} ({report['reason']})"),
        ("fits", "yes" if report["fits"] else "NO"),
        ("checkpoint", f"{format_bytes(report['checkpoint_bytes'])} in {report['layers']} layers "
                       f"(largest {format_bytes(report['largest_layer_bytes'])}), "
                       f"outside the layers {format_bytes(report['non_decoder_bytes'])}"),
        ("compute", f"{report['compute_dtype']} on {report['device']}"
                    + (f", {report['linear_kernel']} linears" if report.get("linear_kernel") else "")
                    + (", packed weights in long prefills" if report.get("packs_weights") else "")
                    + (f" ({report['compute_dtype_reason']})" if report.get("compute_dtype_reason") else "")),
        ("memory", f"peak {format_bytes(report['peak_memory_bytes'])} of a "
                   f"{format_bytes(report['memory_budget_bytes'])} budget "
                   f"(KV cache {format_bytes(report['kv_bytes_per_token'])} per token)"),
        *([("floor", _floor(report))] if report.get("memory_floor") else []),
        *([("token matrices", report["token_matrices_reason"])]
          if report.get("mode") == "streamed" and report.get("token_matrices_reason") else []),
        ("batches", f"{report['batch_count']} of up to {report['batch_size']} sequences / "
                    f"{report['batch_tokens']:,} tokens" + (
                        f" (+ a {report['shared_prefix_tokens']:,}-token prompt prefix computed once, not per row)"
                        if report.get("shared_prefix_tokens") else "")),
        ("passes", f"{report['passes']} (lower bound {report['lower_bound_passes']})"),
        *([("read ahead", _read_ahead(report))] if report.get("prefetch_depth") else []),
        ("read bandwidth", f"{format_rate(report['read_bandwidth_bytes_per_s'])} ({report['bandwidth_basis']}: "
                           f"{report['bandwidth_how']})"),
        ("per pass", f"{format_duration(report['seconds_per_pass'])} (reads "
                     f"{format_duration(report['io_seconds_per_pass'])}, compute "
                     f"{format_duration(report['compute_seconds_per_pass'])})"),
        *([("pass bound", _pass_bound(report))] if report.get("pass_bound_seconds") else []),
        ("ETA", f"{format_duration(report['eta_seconds'])}{_start(report)}; first answer after "
                f"{format_duration(report['first_answer_seconds'])}; "
                f"{_per_hour(report['answers_per_hour'])} answers/hour"),
        ("disk", f"needs {format_bytes(report['disk_needed_bytes'])}; "
                 f"{format_bytes(report['disk_free_bytes'])} free at the checkpoint, {_state_disk_free()}"),
    ]
    width = max(len(label) for label, _ in lines)
    text = [f"{label:<{width}}  {value}" for label, value in lines]
    return "\n".join(text + _listed("blockers", report["blockers"]) + _listed("caveats", report["caveats"]))


def _start(report: Mapping) -> str:
    """What of the ETA `submit` spends before its first pass (job.prepare.with_start_seconds), where it is counted."""
    start = report.get("start_seconds")
    if not start or report.get("eta_seconds") is None:
        return ""
    return (f" from submit ({format_duration(start)} of it to start: importing the runtime, reading and encoding the "
            "spec)")


def _state_disk_free() -> str:
    """Free space where the progress database lives: commits, partial tokens and the answers fill it as a job runs."""
    directory = state_dir(create=False)
    try:
        free = format_bytes(disk_free_bytes(directory))
    except OSError:
        free = "unknown"
    return f"{free} free in the state directory {directory} (progress database)"


def _pass_bound(report: Mapping) -> str:
    """How long a pass may take (what a crash loses at most), and what holding passes to it costs the job."""
    bound = f"at most {format_duration(report['pass_bound_seconds'])} a pass"
    if report.get("unbounded_passes") is None:
        return bound + " (not applied: pass times unknown)"
    bound += f" (longest planned {format_duration(report['longest_pass_seconds'])})"
    extra_passes = report["passes"] - report["unbounded_passes"]
    if extra_passes <= 0:
        return bound + "; no pass cut"
    total = (report.get("eta_seconds") or 0) - (report.get("load_seconds") or 0) - (report.get("start_seconds") or 0)
    cost, unbounded = report["bound_cost_seconds"], total - report["bound_cost_seconds"]
    what = ("each extra pass reads every layer again" if report["mode"] == "streamed"
            else "the weights stay in memory: only each pass's fixed costs")
    spent = (f"{format_duration(cost)}, {cost / unbounded:.1%} of the job" if unbounded > 0 and cost / unbounded >= 5e-4
             else "no measurable time")
    return f"{bound}; {report['passes']:,} passes instead of {report['unbounded_passes']:,} cost {spent} ({what})"


def _floor(report: Mapping) -> str:
    """What a run holds before any sequence, part by part, and what that leaves the sequences."""
    parts = report["memory_floor"]
    total = sum(size for _, size in parts)
    left = report["memory_budget_bytes"] - total
    return (" + ".join(f"{name} {format_bytes(size)}" for name, size in parts) + f" = {format_bytes(total)}; "
            + (f"{format_bytes(left)} of the budget left for sequences" if left > 0
               else f"{format_bytes(-left)} over the budget"))


def _read_ahead(report: Mapping) -> str:
    depth, decoding = report["prefetch_depth"], report.get("decode_prefetch_depth") or report["prefetch_depth"]
    layers = f"{depth} layer{'s' if depth > 1 else ''}"
    if decoding == depth:
        return layers
    return f"{layers} ({decoding} in decode passes, in memory the prefill's activations held)"


def _job_summary(report: Mapping) -> str:
    """The job half of a plan report: rows and tokens (keys the report may lack are left out)."""
    parts = []
    if "spec" in report:
        parts.append(f"job {report['spec']}: {report.get('rows', '?')} rows")
    if report.get("pair_rows"):  # each runs as two requests, counted in the rows above
        pairs = report["pair_rows"]
        parts.append(f"{pairs} pair rows judged in both orders ({2 * pairs} of those rows)")
    if report.get("verdict_rows"):  # a rationale's decode passes, then a choice pass for the verdicts
        parts.append(f"{report['verdict_rows']} write their reasons before their verdict")
    if report.get("invalid_rows"):
        parts.append(f"{report['invalid_rows']} invalid")
    if "prompt_tokens_total" in report:
        parts.append(f"{report['prompt_tokens_total']:,} prompt tokens (longest {report['prompt_tokens_max']:,})")
    if report.get("new_tokens_max"):
        parts.append(f"up to {report['new_tokens_max']} new tokens per row")
    if report.get("unrunnable_rows"):  # too long for the context, or refused by the chat template: errored rows
        parts.append(f"{len(report['unrunnable_rows'])} cannot run (errored rows; `--json` says why)")
    if report.get("repeated_rows"):
        parts.append(f"{report['repeated_rows']} repeat another row exactly (computed once)")
    return "; ".join(parts)


def _column_headers(reports: list[Mapping]) -> list[str]:
    """Model names when the candidates are different models, else their modes."""
    models = [str(r.get("model")) for r in reports]
    return models if len(set(models)) > 1 else [_mode(r) for r in reports]


def _mode(report: Mapping) -> str:
    mode = report.get("mode")
    if mode is None:
        return "unusable"
    return mode + (" (no prefetch)" if mode == "streamed" and not report.get("prefetch", True) else "")


def _per_hour(answers_per_hour: float | None) -> str:
    if answers_per_hour is None:
        return "unknown"
    return f"{answers_per_hour:,.0f}" if answers_per_hour >= 10 else f"{answers_per_hour:.1f}"


def _listed(title: str, sentences: list[str]) -> list[str]:
    return [f"{title}:"] + [f"  - {sentence}" for sentence in sentences] if sentences else []
