"""`python -m batchrun` runs the command line (handy where the console script is not on PATH)."""
from batchrun.cli import cli

if __name__ == "__main__":
    cli(prog_name="batchrun")
