"""The distillation teacher's tokenizer check (distill/teacher_model.py): a teacher must
tokenise exactly as the student, so a tokenizer that differs in any component (not only
the vocabulary) is refused, naming the first difference; the same tokenizer saved and
reloaded is accepted; `consequence train --teacher` refuses with one error line before the
run folder is touched."""

from __future__ import annotations

import json
import shutil

import pytest
from transformers import AutoTokenizer
from typer.testing import CliRunner

from consequence.distill.teacher_model import check_same_tokenizer
from consequence.distill.warmstart import BUNDLED


def _variant(student, folder, edit_json=None, edit_config=None):
    """The student's tokenizer saved to ``folder``, its tokenizer.json / tokenizer_config.json
    edited in place, and loaded back as a teacher would be (AutoTokenizer)."""
    student.save_pretrained(folder)
    for name, edit in (("tokenizer.json", edit_json), ("tokenizer_config.json", edit_config)):
        if edit is not None:
            data = json.loads((folder / name).read_text())
            edit(data)
            (folder / name).write_text(json.dumps(data))
    return AutoTokenizer.from_pretrained(folder)


def _swap_merges(data, i=0, j=4):
    merges = data["model"]["merges"]
    merges[i], merges[j] = merges[j], merges[i]


def test_same_vocabulary_other_merges_is_refused_naming_the_first_merge(tiny_tokenizer, tmp_path):
    merges = json.loads(tiny_tokenizer.backend_tokenizer.to_str())["model"]["merges"]
    teacher = _variant(tiny_tokenizer, tmp_path / "t", _swap_merges)
    assert teacher.get_vocab() == tiny_tokenizer.get_vocab()  # the old id-for-id check saw no difference
    text = "def find_max(xs):\n    best = 0\n    for x in xs:\n        if x > best:"
    # the swap matters: the same text becomes other ids, so the teacher would score ids it never produces
    assert teacher.encode(text, add_special_tokens=False) != tiny_tokenizer.encode(text, add_special_tokens=False)
    with pytest.raises(ValueError) as e:
        check_same_tokenizer(tiny_tokenizer, teacher, "--teacher T")
    assert str(e.value).startswith(
        "--teacher T: its tokenizer differs from the student's in its BPE merges: "
        f"merge #0 (counting from 0, in rank order) is {' '.join(merges[0])!r} for the "
        f"student and {' '.join(merges[4])!r} for the teacher (both have {len(merges)} "
        "merges); distillation compares the log-probs"
    )


@pytest.mark.parametrize(
    "name,edit_json,edit_config,needle",
    [
        (
            "normalizer",
            lambda d: d.update(normalizer={"type": "NFC"}),
            None,
            'its normalizer is absent for the student and {"type": "NFC"} for the teacher',
        ),
        (
            "pre-tokenizer",
            lambda d: d["pre_tokenizer"].update(add_prefix_space=True),
            None,
            "its pre-tokenizer (pre_tokenizer.add_prefix_space) is false for the student and true for the teacher",
        ),
        (
            "eos role",
            None,
            lambda d: d.update(eos_token="<|endoftext|>"),
            "its special tokens: the eos token is '<|im_end|>' for the student and '<|endoftext|>' for the teacher",
        ),
        (
            "bos role",
            None,
            lambda d: d.update(bos_token="<|im_start|>"),
            "its special tokens: the bos token is not set for the student and '<|im_start|>' for the teacher",
        ),
        (
            "added-token flag",
            lambda d: d["added_tokens"][3].update(special=True),
            None,
            "its added tokens: the token with id 316 ('<tool_call>') has special=false for the student and "
            "special=true for the teacher",
        ),
        (
            "model setting",
            lambda d: d["model"].update(byte_fallback=True),
            None,
            "its BPE model (model.byte_fallback) is false for the student and true for the teacher",
        ),
        (
            "post-processor",
            lambda d: d["post_processor"]["single"].insert(0, {"SpecialToken": {"id": "<|im_start|>", "type_id": 0}}),
            None,
            "its post-processor (post_processor.single) is",
        ),
        ("decoder", lambda d: d.update(decoder={"type": "Fuse"}), None, 'and {"type": "Fuse"} for the teacher'),
    ],
)
def test_a_difference_in_one_component_is_refused_naming_it(
    tiny_tokenizer, tmp_path, name, edit_json, edit_config, needle
):
    teacher = _variant(tiny_tokenizer, tmp_path / "t", edit_json, edit_config)
    assert teacher.get_vocab() == tiny_tokenizer.get_vocab()  # only that component differs
    assert tiny_tokenizer.convert_ids_to_tokens(316) == "<tool_call>"  # the id the flag case names
    with pytest.raises(ValueError, match="distillation compares the log-probs") as e:
        check_same_tokenizer(tiny_tokenizer, teacher)
    assert needle in str(e.value), name


def test_the_vocabulary_is_compared_first_and_a_reloaded_copy_is_accepted(tiny_tokenizer, tmp_path):
    from consequence.distill.teacher_model import tokenizer_difference

    # negative control: the same tokenizer, saved and reloaded (what a checkpoint of the student holds)
    same = _variant(tiny_tokenizer, tmp_path / "same")
    assert tokenizer_difference(tiny_tokenizer, same) is None
    check_same_tokenizer(tiny_tokenizer, same)
    # an extra token and other merges: the vocabulary, compared first, is what is named
    other = _variant(tiny_tokenizer, tmp_path / "other", _swap_merges)
    other.add_tokens(["<extra>"])
    n = len(tiny_tokenizer)
    assert tokenizer_difference(tiny_tokenizer, other) == (
        f"its vocabulary: id {n} is '(none)' for the student and '<extra>' for the teacher ({n} vs {n + 1} tokens)"
    )


class _Slow:
    """A tokenizer without a `tokenizers` backend (a "slow" one): everything but the backend."""

    def __init__(self, tok):
        self._tok = tok

    def __getattr__(self, name):
        if name in ("backend_tokenizer", "_tokenizer"):
            raise AttributeError(name)
        return getattr(self._tok, name)


def test_slow_tokenizers_are_compared_by_how_they_split_a_probe_text(tiny_tokenizer, tmp_path):
    from consequence.distill.teacher_model import PROBE, tokenizer_difference

    other = _variant(tiny_tokenizer, tmp_path / "t", _swap_merges)
    a, b = (t.encode(PROBE, add_special_tokens=False) for t in (tiny_tokenizer, other))
    k = next(k for k, (x, y) in enumerate(zip(a, b)) if x != y)  # the direct computation of the first difference
    assert tokenizer_difference(_Slow(tiny_tokenizer), _Slow(other)) == (
        f"how it splits text: a probe text encodes to {len(a)} ids for the student and {len(b)} for the teacher, "
        f"first different at position {k} (id {a[k]} vs id {b[k]})"
    )
    assert tokenizer_difference(_Slow(tiny_tokenizer), _Slow(_variant(tiny_tokenizer, tmp_path / "s"))) is None


@pytest.mark.slow
def test_train_with_such_a_teacher_prints_one_error_line_and_leaves_the_run_folder(tmp_path):
    from consequence.cli import app

    teacher = tmp_path / "teacher"
    shutil.copytree(BUNDLED, teacher)  # the student's own weights: only the merges differ
    data = json.loads((teacher / "tokenizer.json").read_text())
    _swap_merges(data)
    (teacher / "tokenizer.json").write_text(json.dumps(data))
    run = tmp_path / "run"  # an earlier run's folder: a refusal must not clear it
    run.mkdir()
    (run / "manifest.json").write_text(json.dumps({"config": {"run_dir": str(run)}, "status": "finished"}))
    (run / "metrics.jsonl").write_text('{"iteration": 0}\n')
    res = CliRunner().invoke(
        app,
        [
            "train",
            "--advantage",
            "reverse_kl",
            "--teacher",
            str(teacher),
            "--model",
            str(BUNDLED),
            "--run-dir",
            str(run),
            "--iterations",
            "1",
            "--tasks-per-iteration",
            "1",
            "--group-size",
            "2",
            "--eval-every",
            "0",
            "--final-eval-episodes",
            "0",
            "--max-turns",
            "1",
            "--max-new-tokens",
            "8",
        ],
        env={"COLUMNS": "2000"},
    )
    errors = [line for line in res.output.splitlines() if line.startswith("error:")]
    assert res.exit_code == 2, res.output
    assert len(errors) == 1 and "Traceback" not in res.output and res.exception.__class__ is SystemExit
    assert errors[0].startswith(
        f"error: --teacher {teacher}: its tokenizer differs from the student's in its BPE merges: merge #0"
    )
    assert json.loads((run / "manifest.json").read_text())["status"] == "finished"  # the earlier run, untouched
    assert (run / "metrics.jsonl").read_text() == '{"iteration": 0}\n'
