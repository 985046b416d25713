"""A registry model's GGUF file dequantised by transformers and saved as a float32 safetensors checkpoint, then
checked: its config, every saved tensor bit for bit, and its logits against the model it was converted from. torch
and transformers are imported inside the functions that convert and check."""
from __future__ import annotations

import functools
import json
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from batchrun.checkpoint.registry import DEFAULT_REGISTRY_MODEL, DefaultModelError, RegistryModel

# The saved tensors must equal the converted ones bit for bit. The logits of the two models then differ only by
# float32 rounding, which on some CPUs is not reproducible call to call: a small share of the largest logit. A config
# or tokenizer that reloads differently moves the logits by whole units, so the bound is relative to the largest
# logit (docs/models.md#how-a-model-is-provisioned).
MAX_RELATIVE_LOGIT_DIFFERENCE = 1e-3
PROBE_MESSAGE = "Is this review positive or negative? 'The battery lasts all day and the screen is sharp.'"


def convert(model: RegistryModel, gguf_path: Path, out_dir: Path) -> float:
    """Dequantise the GGUF to a float32 safetensors checkpoint in out_dir; return the verified logit difference."""
    try:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as exc:
        raise DefaultModelError(f"converting {model.name} needs torch and transformers ({exc})") from exc
    try:
        with gguf_parsed_once():
            loaded = AutoModelForCausalLM.from_pretrained(
                gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
            )
            tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    except ImportError as exc:
        raise DefaultModelError(f"reading {gguf_path.name} needs the gguf package: pip install gguf ({exc})") from exc
    except Exception as exc:
        raise DefaultModelError(
            f"transformers could not load {gguf_path.name} ({type(exc).__name__}: {exc}); "
            f"pass --model PATH to use another model"
        ) from exc
    loaded.eval()
    # The weights are already dequantised; the attached GGUF quantizer only makes save_pretrained refuse.
    loaded.hf_quantizer = None
    if hasattr(loaded.config, "quantization_config"):
        del loaded.config.quantization_config
    loaded.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    check_config(out_dir, model)
    check_saved_tensors(out_dir, loaded)
    return max_logit_difference(out_dir, loaded, chat_template=model.chat_template)


@contextmanager
def gguf_parsed_once() -> Iterator[None]:
    """Make transformers reuse one GGUFReader per file and one tensor-name map per architecture.

    transformers 5.24 parses the GGUF metadata (49k-token vocabulary, field by field) four times to load model
    and tokenizer, and rebuilds gguf's tensor-name map once per module; sharing them cuts provisioning by about a
    third (docs/models.md#how-a-model-is-provisioned). Both are read-only. If gguf is missing, loading reports that
    itself.
    """
    try:
        import gguf
    except ImportError:
        yield
        return
    original_reader, original_name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers: dict = {}

    def shared_reader(path, *args, **kwargs):
        key = (os.fspath(path), args, tuple(sorted(kwargs.items())))
        if key not in readers:
            readers[key] = original_reader(path, *args, **kwargs)
        return readers[key]

    gguf.GGUFReader = shared_reader
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(original_name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = original_reader, original_name_map
        readers.clear()  # releases the memory maps of the GGUF file


def check_config(directory: Path, model: RegistryModel = DEFAULT_REGISTRY_MODEL) -> None:
    """Raise DefaultModelError unless directory/config.json says what `model`'s config must (the default's: llama,
    30 layers, tied embeddings)."""
    config = json.loads((directory / "config.json").read_text())
    problems = [
        f"{key} is {config.get(key)!r}, expected {expected!r}"
        for key, expected in model.expected_config.items()
        if config.get(key) != expected
    ]
    if problems:
        raise DefaultModelError(
            f"the converted checkpoint in {directory} is not {model.label}: {'; '.join(problems)}"
        )


def max_logit_difference(directory: Path, reference_model, chat_template: bool = True) -> float:
    """Reload the checkpoint in `directory` and return its largest logit difference from `reference_model`.

    Raises DefaultModelError if the saved tokenizer has a chat template where it should not or lacks one where it
    should (chat_template), or the difference exceeds MAX_RELATIVE_LOGIT_DIFFERENCE of the largest logit.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(directory)
    if bool(tokenizer.chat_template) != chat_template:
        raise DefaultModelError(f"the tokenizer saved in {directory} {'has no' if chat_template else 'has a'} "
                                f"chat template, unlike the model it was converted from")
    reloaded = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    if chat_template:
        messages = [{"role": "user", "content": PROBE_MESSAGE}]
        input_ids = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
        )["input_ids"]
    else:  # a base model reads the prompt as it is, after its BOS
        input_ids = tokenizer(PROBE_MESSAGE, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        expected = reference_model(input_ids).logits
        difference = (expected - reloaded(input_ids).logits).abs().max().item()
    allowed = MAX_RELATIVE_LOGIT_DIFFERENCE * expected.abs().max().item()
    if not difference <= allowed:  # written so that NaN fails too
        raise DefaultModelError(
            f"the checkpoint saved in {directory} gives logits up to {difference:.3g} away from the model it was "
            f"converted from (allowed {allowed:.3g}); report this with your torch/transformers versions"
        )
    return difference


def check_saved_tensors(directory: Path, reference_model) -> None:
    """Raise DefaultModelError unless every tensor saved in `directory` equals the reference model's bit for bit,
    and every tensor of the model is saved or is the very tensor of a saved one (tied embeddings)."""
    import torch
    from safetensors import safe_open

    expected = reference_model.state_dict()
    saved_names = set()
    for shard in sorted(directory.glob("*.safetensors")):
        with safe_open(shard, framework="pt") as tensors:
            for name in tensors.keys():  # one at a time: a second copy of the whole model is not needed
                if name not in expected:
                    raise DefaultModelError(f"the checkpoint saved in {directory} holds {name}, which the model it "
                                            f"was converted from does not")
                if not torch.equal(tensors.get_tensor(name), expected[name]):
                    raise DefaultModelError(f"the checkpoint saved in {directory} holds another {name} than the "
                                            f"model it was converted from")
                saved_names.add(name)
    saved_pointers = {expected[name].data_ptr() for name in saved_names}
    for name, tensor in expected.items():
        if name not in saved_names and tensor.data_ptr() not in saved_pointers:
            raise DefaultModelError(f"the checkpoint saved in {directory} lacks the tensor {name}")


def library_versions() -> dict:
    import torch
    import transformers

    return {"torch": torch.__version__, "transformers": transformers.__version__}
