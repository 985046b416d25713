"""--dtype auto on the CPU: a bfloat16 checkpoint computes in bfloat16 where the CPU has bfloat16 units (as plain
transformers loads it by default), in float32 elsewhere (compute_dtype.py)."""
from __future__ import annotations

import re

import pytest
import torch
from click.testing import CliRunner
from transformers import AutoModelForCausalLM, AutoTokenizer

from batchrun.cli import cli
from batchrun.host import compute_dtype
from batchrun.runtime import ResidentModel, StreamedModel
from tests.support import REVIEWS, bfloat16_copy, choice_spec, reference_choice_probs, run_job

CPUINFO_FLAGS = "flags\t\t: fpu vme sse2 avx2 avx512f {extra} sha_ni\n"


@pytest.fixture(scope="module")
def bfloat16_checkpoint(tiny_checkpoint, tmp_path_factory):
    """The tiny Llama stored in bfloat16, as most open checkpoints are."""
    return bfloat16_copy(tiny_checkpoint("llama"), tmp_path_factory.mktemp("bf16") / "llama-bf16")


@pytest.fixture
def cpu_feature(monkeypatch):
    """cpu_feature(name or None): pretend this CPU has (or lacks) bfloat16 units."""
    def pretend(feature):
        monkeypatch.setattr(compute_dtype, "cpu_bfloat16_feature", lambda: feature)
    return pretend


@pytest.mark.parametrize("extra, feature", [("avx512_bf16", "avx512_bf16"),
                                            ("amx_tile amx_bf16 avx512_bf16", "amx_bf16"), ("avx512_vnni", None)])
def test_the_bfloat16_units_are_read_from_the_cpu_flags(tmp_path, extra, feature):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nmodel name\t: Some CPU\n" + CPUINFO_FLAGS.format(extra=extra))
    assert compute_dtype.cpu_bfloat16_feature.__wrapped__(cpuinfo) == feature


def test_no_flags_line_or_no_cpuinfo_means_no_bfloat16_units(tmp_path):
    arm = tmp_path / "arm"
    arm.write_text("processor\t: 0\nFeatures\t: fp asimd bf16\n")  # aarch64 names: not the x86 features checked
    assert compute_dtype.cpu_bfloat16_feature.__wrapped__(arm) is None
    assert compute_dtype.cpu_bfloat16_feature.__wrapped__(tmp_path / "missing") is None


@pytest.mark.parametrize("model_class", [StreamedModel, ResidentModel])
def test_the_runtime_resolves_auto_from_the_checkpoint_and_the_cpu(bfloat16_checkpoint, tiny_checkpoint, cpu_feature,
                                                                   model_class):
    cpu_feature("avx512_bf16")
    for checkpoint, dtype in ((bfloat16_checkpoint, torch.bfloat16), (tiny_checkpoint("llama"), torch.float32)):
        with model_class(checkpoint, device="cpu") as model:
            assert model.dtype == dtype
    cpu_feature(None)
    with model_class(bfloat16_checkpoint, device="cpu") as model:
        assert model.dtype == torch.float32
    cpu_feature("avx512_bf16")
    with model_class(bfloat16_checkpoint, device="cpu", dtype="float32") as model:
        assert model.dtype == torch.float32


@pytest.mark.parametrize("streaming", ["never", "always"])
def test_a_bfloat16_run_equals_plain_transformers_loading_the_checkpoint_as_stored(tmp_path, bfloat16_checkpoint,
                                                                                   cpu_feature, streaming):
    cpu_feature("avx512_bf16")
    reference = AutoModelForCausalLM.from_pretrained(bfloat16_checkpoint).eval()  # transformers' own default dtype
    assert reference.dtype == torch.bfloat16
    tokenizer = AutoTokenizer.from_pretrained(bfloat16_checkpoint)
    plans = []
    summary, rows = run_job(choice_spec(tmp_path), tmp_path, bfloat16_checkpoint, "bf16", streaming=streaming,
                            on_plan=plans.append)
    assert plans[0].compute_dtype == "bfloat16" and "avx512_bf16" in plans[0].compute_dtype_reason
    for row, text in zip(rows, REVIEWS):
        expected = reference_choice_probs(reference, tokenizer, f"Review: {text}\nIs it positive or negative?",
                                          ["positive", "negative"])
        got = dict(row["choice_probs"])
        for choice, p in expected.items():
            assert got[choice] == pytest.approx(p, abs=3e-4)  # bfloat16 against float32 differs by up to 6e-4


def test_plan_says_why_auto_chose_the_dtype(tmp_path, bfloat16_checkpoint, tiny_checkpoint, cpu_feature):
    spec = choice_spec(tmp_path)

    def compute_line(model, *extra):
        result = CliRunner().invoke(cli, ["plan", str(spec), "--model", str(model), *extra])
        assert result.exit_code == 0, result.output
        return re.search(r"^compute\s+(.*)$", result.stdout, re.M).group(1)

    cpu_feature("amx_bf16")
    assert re.fullmatch(r"bfloat16 on cpu, aten linears \(auto: the checkpoint's bfloat16, which this CPU multiplies "
                        r"natively \(amx_bf16\); --dtype float32 for float32\)", compute_line(bfloat16_checkpoint))
    assert compute_line(bfloat16_checkpoint, "--dtype", "float32").startswith("float32 on cpu, ")
    assert "auto" not in compute_line(bfloat16_checkpoint, "--dtype", "float32")
    assert "auto" not in compute_line(tiny_checkpoint("llama"))  # float32 stored: nothing to choose
    cpu_feature(None)
    assert compute_line(bfloat16_checkpoint).endswith("(auto: float32, as this CPU has no bfloat16 units "
                                                      "(AVX512-BF16 or AMX) for the checkpoint's bfloat16)")
