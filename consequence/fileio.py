"""File-writing helpers shared by every box that writes (checkpoints, states, records)."""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path


def as_write_error(e: BaseException, path: Path) -> OSError | None:
    """The OSError behind a failed write, or None when ``e`` is not an I/O failure.

    torch.save reports a full disk as a RuntimeError (the OSError is its ``__context__``)
    and safetensors as a SafetensorError whose text holds "os error N"; the trainer
    recognises write failures by their errno, so they are turned back into OSErrors.
    """
    seen: BaseException | None = e
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno:
            return seen if seen is e else OSError(seen.errno, seen.strerror, seen.filename or str(path))
        seen = seen.__cause__ or seen.__context__
    m = re.search(r"os error (\d+)|errno (\d+)", str(e))
    if m is None:
        return None
    code = int(m.group(1) or m.group(2))
    return OSError(code, os.strerror(code), str(path))


def cache_root() -> Path:
    """``$CONSEQUENCE_CACHE``, default ``~/.cache/consequence`` (warm starts, task sets, ledger)."""
    return Path(os.environ.get("CONSEQUENCE_CACHE", Path.home() / ".cache" / "consequence"))


def check_model_out(out: str | os.PathLike, sources: dict[str, Path], what: str) -> None:
    """``out`` may receive a model folder, which is written whole and replaces what is there:
    a new folder, or an earlier model folder (``config.json``, no adapter), never a folder of
    other files, and never a source folder, inside one or above one.

    Args:
        out: the ``--out`` the user gave.
        sources: name → folder that the command reads (e.g. ``{"the model": path}``).
        what: what is written, for the messages (e.g. "the student").

    Raises:
        ValueError: ``out`` is empty, an existing file, a source (or inside or above one), or
            an existing folder that holds other files than a model's.
    """
    if not str(out).strip():
        raise ValueError(f"--out is empty: name the folder to write {what} into")
    o = Path(out).resolve()
    if o.is_file():
        raise ValueError(f"--out {out} is an existing file: name a folder")
    for name, src in sources.items():
        s = Path(src).resolve()
        if o == s or s in o.parents or o in s.parents:
            raise ValueError(
                f"--out {out} is {name} {s}, inside it or above it, which this command reads: write {what} elsewhere"
            )
    if (
        o.is_dir()
        and any(o.iterdir())
        and not ((o / "config.json").is_file() and not (o / "adapter_config.json").is_file())
    ):
        raise ValueError(
            f"--out {out} is a folder that holds other files, not a model: its contents would be "
            "replaced; name a new folder"
        )


def write_text_atomic(path: str | os.PathLike, text: str) -> Path:
    """Replace ``path`` by ``text`` (UTF-8): a temporary sibling, fsync, then rename.

    A failed write (e.g. a full disk) removes the temporary file and leaves the old
    ``path`` as it was; the error is re-raised. Creates the parent folder.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def append_line(path: str | os.PathLike, line: str) -> None:
    """Append one line durably; a failed write (e.g. disk full) is cut off, never left half-written."""
    data = (line + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
    try:
        size = os.fstat(fd).st_size
        try:
            view = memoryview(data)
            while view:  # os.write may write less than asked
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        except BaseException:
            os.ftruncate(fd, size)
            raise
    finally:
        os.close(fd)


def strict_json(obj, **kwargs) -> str:
    """``json.dumps`` that writes strict JSON: a NaN or ±inf float (a statistic over no
    data) becomes ``null``, as every JSON reader accepts; ``kwargs`` go to ``json.dumps``."""
    return json.dumps(_finite(obj), allow_nan=False, **kwargs)


def _finite(obj):
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj
