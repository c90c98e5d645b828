"""Policy folders for evaluation tests: copies of the bundled model and fake run folders.

``other_policy`` writes a copy whose weights differ from the bundled ones in one number
(the pad token's embedding, which the model never reads as input and whose logit is
far below the others), so its sha256 differs while its samples stay the same: a
different policy by hash that behaves identically. ``fake_run`` makes a run folder
(``config.yaml`` + ``checkpoints/final``) as ``consequence train`` leaves it.
"""

import shutil
from pathlib import Path

import yaml

from consequence.policy.tiny import BUNDLED


def other_policy(dst: Path, delta: float = 1e-6) -> Path:
    """A copy of the bundled model at ``dst`` with one weight moved by ``delta`` (written now)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(BUNDLED, dst)
    weights = load_file(str(dst / "model.safetensors"))
    weights["model.embed_tokens.weight"][0, 0] += delta
    save_file(weights, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def fake_run(run: Path, delta: float = 1e-6, **config) -> Path:
    """A run folder whose ``checkpoints/final`` is :func:`other_policy` with ``delta`` (runs
    with different deltas have different weights) and whose ``config.yaml`` holds ``config``."""
    final = run / "checkpoints" / "final"
    final.parent.mkdir(parents=True)
    other_policy(final, delta)
    (run / "config.yaml").write_text(yaml.safe_dump({"run_dir": str(run), "seed": 0, **config}))
    return run
