"""A smaller student from a teacher's layers (policy/shrink.py): same tokenizer, the kept
layers' weights, and logits equal to running those layers of the teacher directly."""

from __future__ import annotations

import pytest
import torch
from typer.testing import CliRunner

from consequence.cli import app
from consequence.policy.shrink import evenly_spaced, keep_layers
from consequence.policy.tiny import BUNDLED, load_policy


def test_evenly_spaced_keeps_the_ends():
    assert evenly_spaced(30, 10) == [0, 3, 6, 10, 13, 16, 19, 23, 26, 29]
    assert evenly_spaced(4, 2) == [0, 3] and evenly_spaced(4, 4) == [0, 1, 2, 3] and evenly_spaced(5, 1) == [0]
    with pytest.raises(ValueError, match="keep between 1 and the model's 4 layers"):
        evenly_spaced(4, 5)


def test_kept_layers_compute_what_the_teacher_s_layers_compute():
    teacher, tok = load_policy(BUNDLED)
    n = teacher.config.num_hidden_layers
    keep = [0, n - 1]
    student = keep_layers(teacher, keep)
    assert student.config.num_hidden_layers == 2 and len(student.model.layers) == 2
    ids = torch.tensor([tok.encode("def add(a, b):\n    return a + b")])
    with torch.no_grad():
        # the direct computation: the teacher's own modules, only the kept layers, in order
        h = teacher.model.embed_tokens(ids)
        pos = torch.arange(ids.shape[1]).unsqueeze(0)
        rope = teacher.model.rotary_emb(h, pos)
        for k in keep:
            h = teacher.model.layers[k](h, position_embeddings=rope, position_ids=pos, attention_mask=None)
            h = h[0] if isinstance(h, tuple) else h
        direct = teacher.lm_head(teacher.model.norm(h))
        got = student(input_ids=ids).logits
    assert torch.allclose(got, direct, atol=1e-5)
    assert not torch.allclose(got, teacher(input_ids=ids).logits, atol=1e-2)  # it really dropped layers
    assert torch.equal(student.model.layers[1].mlp.up_proj.weight, teacher.model.layers[n - 1].mlp.up_proj.weight)
    with pytest.raises(ValueError, match="give distinct indices"):
        keep_layers(teacher, [0, 0])


@pytest.mark.slow
def test_cli_shrink_writes_a_student_that_shares_the_tokenizer(tmp_path):
    from consequence.distill.teacher_model import load_teacher

    res = CliRunner().invoke(app, ["shrink", str(BUNDLED), "--layers", "2", "--out", str(tmp_path / "s")])
    assert res.exit_code == 0, res.output
    assert "kept layers" in res.output
    student, tok = load_policy(tmp_path / "s")
    assert student.config.num_hidden_layers == 2
    load_teacher(BUNDLED, tok, student=student)  # the teacher check accepts the pair
    res = CliRunner().invoke(app, ["shrink", str(BUNDLED), "--layers", "99", "--out", str(tmp_path / "t")])
    assert res.exit_code == 2 and "keep between 1 and" in res.output and not (tmp_path / "t").exists()


@pytest.mark.slow
def test_shrink_never_writes_over_the_teacher_or_other_files(tmp_path):
    """--out is replaced whole: refused where that would delete the teacher or files of the user."""
    import shutil

    teacher = tmp_path / "parent" / "teacher"
    shutil.copytree(BUNDLED, teacher)
    (tmp_path / "parent" / "notes.txt").write_text("precious")
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "notes.txt").write_text("precious")
    cases = {
        str(teacher): "is the teacher",
        str(teacher / "student"): "is the teacher",
        str(tmp_path / "parent"): "is the teacher",
        str(victim): "holds other files, not a model",
        str(victim / "notes.txt"): "is an existing file",
    }
    for out, needle in cases.items():
        res = CliRunner().invoke(app, ["shrink", str(teacher), "--layers", "2", "--out", out])
        assert res.exit_code == 2 and needle in res.output, (out, res.output)
    assert (victim / "notes.txt").read_text() == "precious" == (tmp_path / "parent" / "notes.txt").read_text()
    assert load_policy(teacher)[0].config.num_hidden_layers == load_policy(BUNDLED)[0].config.num_hidden_layers
    res = CliRunner().invoke(app, ["shrink", str(tmp_path / "none"), "--layers", "2", "--out", str(tmp_path / "s")])
    assert res.exit_code == 2 and "no such model folder" in res.output and "--out" not in res.output
    # an earlier student is a model folder: writing a new one over it is allowed
    for _ in range(2):
        res = CliRunner().invoke(app, ["shrink", str(teacher), "--layers", "2", "--out", str(tmp_path / "s")])
        assert res.exit_code == 0, res.output
