"""`batchrun quantize`: a safetensors checkpoint written as a quantized GGUF file."""
from __future__ import annotations

import json
from pathlib import Path

import click

from batchrun.checkpoint import QUANT_TYPES, QuantizeRequest, progress_bars, quantize_checkpoint


@click.command()
@click.argument("checkpoint", type=click.Path(path_type=Path))
@click.option("--output", "-o", type=click.Path(path_type=Path), required=True,
              help="The GGUF file to write (replaced only with --force).")
@click.option("--type", "quant_type", type=click.Choice(QUANT_TYPES), default="q8_0", show_default=True,
              help="Block type of the matrices; norms and biases stay float32, the head Q8_0.")
@click.option("--force", is_flag=True, help="Replace an existing output file.")
@click.option("--allow-nfc-loss", is_flag=True,
              help="Write a tokenizer whose NFC normalizer GGUF cannot carry (Qwen2's): text in NFC form, most "
                   "text, splits alike; decomposed accents do not.")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar.")
@click.option("--json", "as_json", is_flag=True, help="Print what was written as JSON.")
def quantize(checkpoint, output, quant_type, force, allow_nfc_loss, quiet, as_json):
    """Write CHECKPOINT (a Llama or Qwen2 safetensors directory with its tokenizer) as a GGUF file of Q8_0, Q4_0
    or Q4_1 blocks, tensor by tensor. The config and tokenizer the file carries are checked to read back as the
    checkpoint's own before a weight is read; run it with --model FILE.gguf."""
    request = QuantizeRequest(checkpoint, output, quant_type, force=force, allow_nfc_loss=allow_nfc_loss)
    with progress_bars(not quiet and not as_json):
        result = quantize_checkpoint(request)
    if as_json:
        click.echo(json.dumps({"output": str(result.output), "type": result.quant_type, "tensors": result.tensors,
                               "source_bytes": result.source_bytes, "written_bytes": result.written_bytes,
                               "pre_tokenizer": result.pre_tokenizer, "seconds": round(result.seconds, 3)},
                              indent=2))
        return
    click.echo(f"{result.output}: {result.tensors} tensors, {result.written_bytes / 1e6:.1f} MB "
               f"({result.written_bytes / result.source_bytes:.2f}x of {result.source_bytes / 1e6:.1f} MB) as "
               f"{result.quant_type}, tokenizer.ggml.pre {result.pre_tokenizer!r}, {result.seconds:.1f} s")
