"""Where the models compute and in which precision: ``--device``, ``--teacher-device``, ``--dtype``
(docs/devices.md).

Device. A setting (``auto``, ``cpu``, ``cuda``, ``cuda:N``, ``mps``; its spelling is checked by
``config.TrainConfig``) becomes a ``torch.device`` in :func:`resolve_device`, which refuses a
device this machine does not have before any model loads, naming the option, what torch found
and the fix. ``auto`` is cuda when torch sees a CUDA device, else mps when available, else cpu.

Precision. ``float32`` computes everything in float32 (the default; every reference number of
docs/design.md §8). ``bfloat16`` is mixed precision: parameters, gradients and optimizer state
stay float32 (master weights) and the forward passes run under ``torch.autocast`` in bfloat16
(:func:`precision`: the update's forward, the reference's and teacher's forwards, the sampler).
Log-probs are always taken in float32: the logits are upcast before the log-softmax
(``policy.logprobs``, ``policy.sampler._pick``).

Tolerance. Two computations of one token's log-prob (the sampler's and the trainer's) agree to
float rounding only; :func:`logprob_tolerance` bounds their difference from the precision's unit
roundoff (derivation there), and the pre-step ratio check uses it (docs/design.md §6).
"""

from __future__ import annotations

import contextlib
import os

import torch

from consequence.config import DEVICE_CHOICES, DEVICE_SPEC

DTYPES: tuple[str, ...] = ("float32", "bfloat16")
# Unit roundoff u = 2^-p of a format with p significant bits (the stored mantissa plus the
# implicit leading 1): rounding x to the format leaves |δx| <= u·|x|. bfloat16 keeps 8
# significant bits (7 stored), u = 2^-8 ≈ 3.9e-3; float32 keeps 24, u = 2^-24 ≈ 6.0e-8.
UNIT_ROUNDOFF: dict[str, float] = {"float32": 2.0**-24, "bfloat16": 2.0**-8}
# The float32 tolerance of the ratio check (docs/design.md §6), also the floor of every
# dtype's: float32 recomputations differ by ~1e-5 nats (tiny model; 2.4e-5 on SmolLM2-135M
# against vLLM), far below it.
FLOAT32_LOGPROB_TOL = 1e-3
# |log π − log μ| <= TOLERANCE_UNITS · u · max|logit| for two computations of one log-prob:
# 2 computations × 2 (the log-softmax) × 3 roundings at the LM head (logprob_tolerance derives it)
TOLERANCE_UNITS = 12


def _mps_available() -> bool:
    mps = getattr(torch.backends, "mps", None)
    return bool(mps is not None and mps.is_available())


def resolve_device(spec: str, option: str = "--device") -> torch.device:
    """The ``torch.device`` of a device setting, refused when this machine does not have it.

    Args:
        spec: ``auto``, ``cpu``, ``cuda``, ``cuda:N`` or ``mps`` (case and surrounding
            spaces ignored).
        option: the setting's name in messages (``--device``, ``--teacher-device``).

    Returns:
        ``cpu``, ``cuda:N`` (``cuda`` is the current CUDA device, made explicit) or ``mps``.

    Raises:
        ValueError: a malformed setting; CUDA asked for where ``torch.cuda.is_available()``
            is False (a CPU-only torch build, or no visible device); an index at or beyond
            ``torch.cuda.device_count()``; MPS where it is not available. The message names
            ``option``, what torch found, and how to fix it.
    """
    name = str(spec).strip().lower()
    m = DEVICE_SPEC.fullmatch(name)
    if m is None:
        raise ValueError(f"{option} {spec!r}: not a device; give {DEVICE_CHOICES}")
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "mps" if _mps_available() else "cpu"
    if name == "cpu":
        return torch.device("cpu")
    if name == "mps":
        if not _mps_available():
            built = getattr(getattr(torch.backends, "mps", None), "is_built", lambda: False)()
            why = "torch.backends.mps.is_available() is False: " + (
                "the MPS backend needs macOS 12.3 or later on Apple silicon" if built else "this torch build has no MPS"
            )
            raise ValueError(f"{option} mps: {why}; use {option} cpu, or {option} auto to take what this machine has")
        return torch.device("mps")
    if not torch.cuda.is_available():
        if torch.version.cuda is None:
            why = f"this torch build ({torch.__version__}) is CPU-only"
            fix = "install a CUDA build of torch (https://pytorch.org/get-started/locally/) on a machine with an NVIDIA GPU"
        else:
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            why = f"torch {torch.__version__} is built for CUDA {torch.version.cuda}, but it sees no CUDA device" + (
                f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else " (no GPU, or no driver)"
            )
            fix = "check nvidia-smi and CUDA_VISIBLE_DEVICES"
        raise ValueError(
            f"{option} {name}: torch.cuda.is_available() is False: {why}; use {option} cpu (or auto, which "
            f"takes what this machine has), or {fix}"
        )
    count = torch.cuda.device_count()
    index = int(m.group(1)) if m.group(1) is not None else torch.cuda.current_device()
    if index >= count:
        raise ValueError(
            f"{option} {name}: this machine has {count} CUDA device{'s' if count != 1 else ''} "
            f"(cuda:0{f' … cuda:{count - 1}' if count > 1 else ''}); give one of them, or {option} cuda for the "
            "current one"
        )
    return torch.device("cuda", index)


def model_device(model: torch.nn.Module) -> torch.device:
    """The device of ``model``'s first parameter (where its inputs must go)."""
    return next(model.parameters()).device


def precision(dtype: str, device: torch.device | str) -> contextlib.AbstractContextManager:
    """The context that forward passes on ``device`` run in: nothing for ``float32``;
    ``torch.autocast(device type, torch.bfloat16)`` for ``bfloat16`` (matrix products in
    bfloat16 with float32 accumulation, parameters untouched: they stay float32).

    Enter it around forward passes only (the backward pass runs the recorded casts back); an
    op on another device type than ``device`` is not affected (a teacher on the CPU next to a
    CUDA policy computes in float32).

    Raises:
        ValueError: an unknown ``dtype``.
    """
    if dtype == "float32":
        return contextlib.nullcontext()
    if dtype == "bfloat16":
        return torch.autocast(device_type=torch.device(device).type, dtype=torch.bfloat16)
    raise ValueError(f"dtype {dtype!r}: give one of {', '.join(DTYPES)}")


def logprob_tolerance(dtype: str, logit_scale: float) -> float:
    """The largest |log π − log μ| (nats) two computations of one token's log-prob may differ
    by in precision ``dtype``, when the logits they are taken from are at most ``logit_scale``
    in magnitude; never below :data:`FLOAT32_LOGPROB_TOL`.

    Derivation. Rounding to a format with unit roundoff u (:data:`UNIT_ROUNDOFF`) leaves a
    relative error of at most u. Under bfloat16 autocast a logit z_i = Σ_j w_ij h_j passes
    three roundings at the LM head: autocast rounds its input h (the final hidden state) and
    its weights w to bfloat16, and the product's output z is returned in bfloat16. Counting
    each at u·|z_i| (the head's products taken not to cancel) gives |δz_i| <= 3u·|z_i| <= 3uZ,
    with Z = max_i |z_i|. The log-softmax log p_y = z_y − log Σ_i exp(z_i) has the derivative
    ∂ log p_y / ∂z_i = 1[i = y] − p_i, so δ log p_y = δz_y − Σ_i p_i δz_i and
    |δ log p_y| <= |δz_y| + Σ_i p_i |δz_i| <= 2 · 3uZ = 6uZ, whatever the vocabulary size V
    (the p_i sum to 1 over all V tokens). The sampler and the trainer are two such
    computations with their own roundings (other kernels, other batch shapes), so they may
    differ by up to 2 · 6uZ = 12uZ (:data:`TOLERANCE_UNITS`). The softmax ignores a shift of
    all logits but the rounding does not, so Z is the logits' own largest magnitude (the
    ratio check measures it on the rows it checks). Roundings inside the trunk are not
    counted: under autocast its residual stream stays float32 and each block's bfloat16
    output is rounded relative to that block's own contribution. As a check of the bound,
    not its source: the largest sampler-vs-trainer gaps seen were 0.06 nats on 320 tokens
    of the bundled tiny model on the CPU (Z ≈ 19, bound 0.89), 0.19 on 320 tokens of
    SmolLM2-135M on the CPU (30 layers, Z ≈ 46, bound 2.1), and 0.30 on 49,152 tokens of the
    tiny model on an H200 (Z ≈ 21, bound 0.99; 99.9 % of them within 0.08). A bound of the
    logits' own rounding alone (4uZ) would have been 0.33 there: too close to what was seen.
    For float32, 12uZ stays below the floor for any Z below 1,300, so the float32 tolerance is
    the floor, as before this setting existed.

    Raises:
        ValueError: an unknown ``dtype`` or a negative / non-finite ``logit_scale``.
    """
    if dtype not in UNIT_ROUNDOFF:
        raise ValueError(f"dtype {dtype!r}: give one of {', '.join(DTYPES)}")
    if not logit_scale >= 0 or logit_scale == float("inf"):
        raise ValueError(f"logit_scale must be finite and >= 0, got {logit_scale}")
    return max(FLOAT32_LOGPROB_TOL, TOLERANCE_UNITS * UNIT_ROUNDOFF[dtype] * logit_scale)


def peak_memory_gib(device: torch.device | str) -> dict[str, float]:
    """High-water marks of memory, in GiB (2^30 bytes), for an iteration's metrics.

    ``peak_rss_gib``: this process's largest resident set since it started (Linux: the
    kernel's ``VmHWM`` in ``/proc/self/status``; elsewhere ``getrusage`` ``ru_maxrss``; a
    resumed run starts a new process), the number to compare with the machine's RAM; CPU
    tensors, Python objects and libraries included, child processes (rollout workers,
    update ranks) not. ``device_peak_gib`` (CUDA only):
    the largest memory torch allocated on ``device`` since the previous call
    (``torch.cuda.max_memory_allocated``; the peak is reset after reading), so each
    iteration reports its own peak.
    """
    out = {"peak_rss_gib": _peak_rss_bytes() / 2**30}
    dev = torch.device(device)
    if dev.type == "cuda":
        out["device_peak_gib"] = torch.cuda.max_memory_allocated(dev) / 2**30
        torch.cuda.reset_peak_memory_stats(dev)
    return out


def _peak_rss_bytes() -> int:
    try:  # Linux: the kernel's high-water mark, in kB (ru_maxrss lags it by the per-thread RSS batching)
        with open("/proc/self/status") as f:
            return next(int(x.split()[1]) for x in f if x.startswith("VmHWM:")) * 1024
    except (OSError, StopIteration, ValueError):
        import resource
        import sys

        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return rss if sys.platform == "darwin" else rss * 1024  # bytes on macOS, KiB elsewhere
