"""`eval` and `compare` declare each option once (cli/eval_options.py); the commands take
exactly the table's options, in its order, with its help texts."""

from __future__ import annotations

import ast
from pathlib import Path

import typer.main

from consequence.cli import app
from consequence.cli.eval_options import OPTIONS, ORDER

ROOT = Path(__file__).resolve().parents[2]


def _command(name: str):
    group = typer.main.get_command(app)
    return group.commands[name]  # type: ignore[attr-defined]


def test_no_option_is_declared_in_the_command_module():
    tree = ast.parse((ROOT / "consequence" / "cli" / "evaluate.py").read_text())
    calls = [
        n.func.attr
        for n in ast.walk(tree)
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in ("Option", "Argument")
    ]
    assert calls == []


def test_each_command_takes_the_tables_options_with_their_help():
    shared = set(ORDER["eval"]) & set(ORDER["compare"])
    assert len(shared) == 17 and set(ORDER["eval"]) | set(ORDER["compare"]) == set(OPTIONS)
    for name in ("eval", "compare"):
        params = _command(name).params
        assert [p.name for p in params] == list(ORDER[name])
        for p in params:
            spec = OPTIONS[p.name]
            want = spec.compare_help if name == "compare" and spec.compare_help is not None else spec.help
            assert getattr(p, "help", None) == want, (name, p.name)
    n_eval = next(p for p in _command("eval").params if p.name == "n")
    n_compare = next(p for p in _command("compare").params if p.name == "n")
    assert (n_eval.default, n_compare.default) == (None, 4)  # one declaration, compare's own default


def _same_default(cli: object, python: object) -> bool:
    """The CLI's text forms (k "1", selection "a,b", out Path) against the API's values."""
    if isinstance(python, (tuple, list)):
        return cli == ",".join(python)
    return str(cli) == str(python) if isinstance(cli, Path) or isinstance(python, int) else cli == python


def test_the_python_api_takes_the_tables_options_with_the_same_defaults():
    # cq.evaluate / cq.compare keep explicit typed signatures (for editors and type checkers);
    # this keeps them in step with the table: same names (env_options for the repeated
    # --env-option, no hidden --tasks) and the same defaults.
    import inspect

    from consequence import api

    for command, function in (("eval", api.evaluate), ("compare", api.compare)):
        params = inspect.signature(function).parameters
        names = [n for n in ORDER[command] if n not in ("tasks", "env_option")]
        assert set(params) == {*names, "env_options", "reward_fn"}, command
        for name in names:
            spec = OPTIONS[name]
            default = (
                spec.compare_default if command == "compare" and spec.compare_default is not None else spec.default
            )
            got = params[name].default
            if default is ...:
                assert got is inspect.Parameter.empty, (command, name)
            else:
                assert _same_default(default, got), (command, name, default, got)
