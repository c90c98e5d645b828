"""File-writing helpers shared by every box that writes (checkpoints, states, records)."""

from __future__ import annotations

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
