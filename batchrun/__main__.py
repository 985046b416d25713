"""`python -m batchrun ...`: the same command line as the `batchrun` script, without needing it on PATH."""
from batchrun.cli import cli

cli(prog_name="batchrun")
