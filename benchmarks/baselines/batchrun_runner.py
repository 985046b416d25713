"""`batchrun submit` in this process, so the disk bytes it reads can be counted (/proc/self/io).

    python -m benchmarks.baselines.batchrun_runner RESULT.json SPEC --model CKPT ... (any `batchrun submit` options)

Runs exactly the command line `batchrun submit SPEC ... --json` runs, then writes its JSON summary, the answers from
its Parquet output and the bytes read from storage while it ran to RESULT.json.
"""
from __future__ import annotations

import contextlib
import io
import json
import sys
import time
from pathlib import Path

# Import everything heavy before counting, as the other runners do: a cold import of torch reads hundreds of MB.
import batchrun.job.execute  # noqa: F401
import pyarrow.parquet as parquet
from batchrun.cli import cli

from benchmarks.baselines.common import disk_read_bytes


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    result_path, submit_arguments = Path(argv[0]), argv[1:]
    if "--output" not in submit_arguments:
        raise SystemExit("pass --output so the answers can be read back")
    output = Path(submit_arguments[submit_arguments.index("--output") + 1])
    read_before, started = disk_read_bytes(), time.perf_counter()
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        cli.main(args=["submit", *submit_arguments, "--json"], standalone_mode=False)
    wall = time.perf_counter() - started
    summary = json.loads(printed.getvalue()[printed.getvalue().index("{"):])
    table = parquet.read_table(output, columns=["answer", "output_tokens", "error"]).to_pylist()
    result = {"summary": summary, "answers": table, "wall_in_process_seconds": wall,
              "disk_read_bytes": disk_read_bytes() - read_before}
    result_path.write_text(json.dumps(result, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
