"""An LLM judge as a reward: a rubric, a model behind an OpenAI-compatible URL, a strict score (reward box).

Where no verifier exists, a model can grade an episode against a rubric (Zheng et al. 2023,
"Judging LLM-as-a-Judge with MT-Bench and Chatbot Arena", §3: single-answer grading, and the
position, verbosity and self-enhancement biases measured there; ``consequence judge-check``
measures the first two on our own labels before anyone trains on a judge).

**What the judge sees.** One user message: the rubric, the episode's request (the last user
message before the policy's first reply) and its response (:func:`episode_parts`): the
policy's only reply as it is, or, for a multi-turn episode, the transcript from the request to
the policy's last reply (``[assistant]``, ``[tool call]``, ``[tool NAME]``, ``[user]`` lines).
The environment's observation after the last reply is never shown: it may carry the
verifier's verdict ("correct").

**The score** (:func:`parse_score`): the reply's last non-empty line must be exactly
``SCORE: <number>``, the number written as digits with an optional decimal part, from 0 to 10;
anything else (a missing line, text after it, ``**SCORE: 7**``, ``SCORE: 7/10``, 11) does not
parse. The reward component ``judge`` is w · score / 10 and the environment's components are
scaled by (1 − w) (``--judge-weight w``, 1 = the judge alone; as ``--reward-model``), so the
total stays between the environment's range and [0, 1]; ``verifier_score``, and with it
success, stays the environment's.

**Failures are errors, never zeros.** A reply that does not parse, a timeout, a connection
error or an HTTP error (after the client's bounded retries: :mod:`consequence.reward.judge_client`)
makes the episode an ``env_error`` with the reason in ``error`` (``judge: judge_timeout: ...``),
excluded from the loss and counted (``env_errors``, ``judge_errors``).

**The cache.** A judgement is keyed by sha256 of (judge model, the full prompt: rubric, request
and response, sampling settings); a key already judged is never sent again, within a batch
(identical responses of one group) or later, and with a run folder the cache is kept in
``judge_cache.json`` there (rewritten atomically after each batch with a new judgement), so a
resumed run does not ask again. Failures are not cached.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from consequence.fileio import write_text_atomic
from consequence.records import Trajectory, credited
from consequence.reward.judge_client import JudgeClient, JudgeEndpoint, JudgeFailure, judge_base_url, probe_judge

__all__ = [
    "CACHE_FILE",
    "JUDGE_COMPONENT",
    "SCORE_HIGH",
    "Judge",
    "JudgeCache",
    "Verdict",
    "apply_judge",
    "check_judge",
    "endpoint_of",
    "episode_parts",
    "judge_metrics",
    "judge_record",
    "judge_reward",
    "parse_choice",
    "parse_score",
    "pairwise_messages",
    "pointwise_messages",
    "resolve_rubric",
]

JUDGE_COMPONENT = "judge"
SCORE_HIGH = 10.0  # the rubric's scale is 0 .. SCORE_HIGH; the reward is score / SCORE_HIGH
CACHE_FILE = "judge_cache.json"
_SCORE_LINE = re.compile(r"SCORE:[ \t]*([0-9]+(?:\.[0-9]+)?)")
_CHOICE_LINE = re.compile(r"PREFERRED:[ \t]*([AB])")

POINTWISE_SYSTEM = (
    "You are a strict grader. You are given a rubric, a request and a response to it. Grade the "
    "response by the rubric alone: not by its length, style or confidence. Think briefly if you "
    "need to, then end your reply with one final line of exactly this form:\n"
    "SCORE: <number>\n"
    "where <number> is from 0 (fails the rubric entirely) to 10 (fully meets it). Write nothing after that line."
)
POINTWISE_USER = "# Rubric\n{rubric}\n\n# Request\n{request}\n\n# Response\n{response}"
PAIRWISE_SYSTEM = (
    "You are a strict grader. You are given a rubric, a request and two responses to it, A and B. "
    "Decide which response better meets the rubric: not by length, style or position. Think briefly "
    "if you need to, then end your reply with one final line of exactly this form:\n"
    "PREFERRED: A\n"
    "or\n"
    "PREFERRED: B\n"
    "Write nothing after that line."
)
PAIRWISE_USER = "# Rubric\n{rubric}\n\n# Request\n{request}\n\n# Response A\n{a}\n\n# Response B\n{b}"


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


PROMPT_TEMPLATE_SHA256 = _sha(json.dumps([POINTWISE_SYSTEM, POINTWISE_USER]))
PAIRWISE_TEMPLATE_SHA256 = _sha(json.dumps([PAIRWISE_SYSTEM, PAIRWISE_USER]))


# ---- parsing --------------------------------------------------------------------------------
def _last_line(reply: str) -> str:
    lines = [ln.strip() for ln in reply.splitlines() if ln.strip()]
    if not lines:
        raise ValueError("the reply is empty")
    return lines[-1]


def parse_score(reply: str) -> float:
    """The score of a pointwise reply (module doc): its last non-empty line, stripped, must be
    ``SCORE: <number>`` with 0 ≤ number ≤ 10.

    Raises:
        ValueError: the reply does not end with such a line (the message quotes the line).
    """
    last = _last_line(reply)
    m = _SCORE_LINE.fullmatch(last)
    if m is None:
        raise ValueError(f"the last line {last[:80]!r} is not `SCORE: <number>`")
    score = float(m.group(1))
    if not score <= SCORE_HIGH:
        raise ValueError(f"the score {m.group(1)} is outside [0, {SCORE_HIGH:g}]")
    return score


def parse_choice(reply: str) -> str:
    """``"A"`` or ``"B"`` of a pairwise reply: its last non-empty line must be ``PREFERRED: A`` or ``PREFERRED: B``.

    Raises:
        ValueError: the reply does not end with such a line.
    """
    last = _last_line(reply)
    m = _CHOICE_LINE.fullmatch(last)
    if m is None:
        raise ValueError(f"the last line {last[:80]!r} is not `PREFERRED: A` or `PREFERRED: B`")
    return m.group(1)


# ---- what the judge sees ----------------------------------------------------------------------
def _render(m: dict[str, Any]) -> list[str]:
    """One message of a transcript as lines: its text, then its tool calls."""
    role, content = str(m.get("role")), m.get("content") or ""
    name = f" {m['name']}" if role == "tool" and m.get("name") else ""
    out = [f"[{role}{name}] {content}"] if content or not m.get("tool_calls") else []
    for c in m.get("tool_calls") or []:
        fn = c.get("function") or {}
        args = fn.get("arguments")
        out.append(f"[tool call] {fn.get('name')} {args if isinstance(args, str) else json.dumps(args)}")
    return out


def episode_parts(t: Trajectory) -> tuple[str, str] | None:
    """(request, response) of an episode as the judge sees them (module doc); None when its
    messages hold no reply of the policy (each model call recorded one assistant message, so
    the policy's replies are the last ``len(t.calls)`` of them) or no request before them."""
    msgs = t.messages
    mine = [i for i, m in enumerate(msgs) if m.get("role") == "assistant"][-len(t.calls) :] if t.calls else []
    if not mine or len(mine) < len(t.calls):
        return None
    first, last = mine[0], mine[-1]
    at = next((i for i in range(first - 1, -1, -1) if msgs[i].get("role") == "user"), None)
    if at is None:
        return None
    turns = msgs[at + 1 : last + 1]  # what follows the last reply (the verdict, perhaps) is left out
    if len(turns) == 1 and not turns[0].get("tool_calls"):
        return str(msgs[at].get("content") or ""), str(turns[0].get("content") or "")
    return str(msgs[at].get("content") or ""), "\n".join(line for m in turns for line in _render(m))


def pointwise_messages(rubric: str, request: str, response: str) -> list[dict[str, str]]:
    """The chat messages of one pointwise judgement."""
    user = POINTWISE_USER.format(rubric=rubric.strip(), request=request, response=response)
    return [{"role": "system", "content": POINTWISE_SYSTEM}, {"role": "user", "content": user}]


def pairwise_messages(rubric: str, request: str, a: str, b: str) -> list[dict[str, str]]:
    """The chat messages of one pairwise judgement (response ``a`` shown first, as A)."""
    user = PAIRWISE_USER.format(rubric=rubric.strip(), request=request, a=a, b=b)
    return [{"role": "system", "content": PAIRWISE_SYSTEM}, {"role": "user", "content": user}]


def resolve_rubric(path: str | None, env: Any) -> tuple[str, str]:
    """The rubric's text and where it came from: the file ``path`` (``--judge-rubric``), else the
    environment's own ``rubric`` attribute.

    Raises:
        ValueError: the file cannot be read or is empty, or no file is given and the environment
            defines no rubric (names the option and the fix).
    """
    if path is not None:
        try:
            text = Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"--judge-rubric {path}: cannot read it ({e}); give a UTF-8 text file") from None
        if not text.strip():
            raise ValueError(f"--judge-rubric {path}: the file is empty; write the criteria the judge grades by")
        return text, str(path)
    if env is None:
        raise ValueError("no rubric: give --judge-rubric FILE (the criteria the judge grades by, plain text)")
    own = getattr(env, "rubric", None)
    if not isinstance(own, str) or not own.strip():
        raise ValueError(
            f"--judge-url: --env {getattr(env, 'label', None) or getattr(env, 'name', '?')} defines no rubric; "
            "give one with --judge-rubric FILE (the criteria the judge grades by, plain text)"
        )
    return own, f"environment {getattr(env, 'name', '?')}"


# ---- the cache --------------------------------------------------------------------------------
class JudgeCache:
    """Judgements by key (:meth:`key`), in memory and, with ``path``, in a JSON file rewritten
    atomically by :meth:`save`. Thread-safe.

    Raises:
        ValueError: ``path`` exists and is not a cache file (not a JSON object).
    """

    def __init__(self, path: str | Path | None = None):
        self.path = Path(path) if path is not None else None
        self._lock = threading.Lock()
        self._data: dict[str, Any] = {}
        self._dirty = False
        if self.path is not None and self.path.exists():
            try:
                data = json.loads(self.path.read_text())
            except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
                raise ValueError(f"{self.path}: not a judge cache ({e}); move it away") from None
            if not isinstance(data, dict):
                raise ValueError(f"{self.path}: not a judge cache (not a JSON object); move it away")
            self._data = data

    @staticmethod
    def key(model: str, messages: list[dict[str, str]], max_tokens: int) -> str:
        """sha256 of the judge model, the prompt (rubric, request, response) and the sampling settings."""
        return _sha(json.dumps([model, messages, 0.0, max_tokens], sort_keys=True))

    def get(self, key: str) -> Any:
        with self._lock:
            return self._data.get(key)

    def put(self, key: str, value: Any) -> None:
        with self._lock:
            self._data[key] = value
            self._dirty = True

    def __len__(self) -> int:
        return len(self._data)

    def save(self) -> None:
        """Write the file (atomically: a temporary sibling, then rename) when something new came."""
        with self._lock:
            if self.path is None or not self._dirty:
                return
            text = json.dumps(self._data, sort_keys=True)
            self._dirty = False
        write_text_atomic(self.path, text)


# ---- the judge ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Verdict:
    """One judgement: ``value`` (a score, or ``"A"`` / ``"B"``) or ``error`` (``reason: detail``)."""

    value: Any
    error: str | None = None
    cached: bool = False


class Judge:
    """A judge: an endpoint, a rubric, a cache; judgements asked ``concurrency`` at a time.

    Args:
        endpoint: the server and its settings.
        rubric: the criteria text.
        cache: where judgements are kept (default: in memory only).
        client: the HTTP client (default: :class:`JudgeClient` of ``endpoint``).

    Attributes:
        asked: judgements sent to the server (each may take several HTTP requests: retries).
        cache_hits: judgements answered from the cache (or by an identical one in the same batch).
    """

    def __init__(
        self, endpoint: JudgeEndpoint, rubric: str, cache: JudgeCache | None = None, client: JudgeClient | None = None
    ):
        self.endpoint, self.rubric = endpoint, rubric
        self.cache = cache if cache is not None else JudgeCache()
        self.client = client if client is not None else JudgeClient(endpoint)
        self.asked = self.cache_hits = 0

    def ask(
        self,
        prompts: Sequence[list[dict[str, str]]],
        parse: Callable[[str], Any],
        progress: Callable[[int, int], None] | None = None,
    ) -> list[Verdict]:
        """One verdict per prompt, in order: each distinct prompt not in the cache is sent once
        (``endpoint.concurrency`` in flight), parsed with ``parse`` (a ``ValueError`` from it is
        ``judge_unparsable_score``); successes are cached and the cache saved. ``progress(done,
        total)``, when given, is called as the requests to send finish (from the pool's threads)."""
        keys = [JudgeCache.key(self.endpoint.model, p, self.endpoint.max_tokens) for p in prompts]
        todo: dict[str, list[dict[str, str]]] = {}
        for k, p in zip(keys, prompts):
            if self.cache.get(k) is None:
                todo.setdefault(k, p)
        self.asked += len(todo)
        self.cache_hits += len(keys) - len(todo)
        got: dict[str, Verdict] = {}
        if todo:
            done, lock = [0], threading.Lock()

            def one(p: list[dict[str, str]]) -> Verdict:
                v = self._one(p, parse)
                if progress is not None:
                    with lock:
                        done[0] += 1
                        progress(done[0], len(todo))
                return v

            with ThreadPoolExecutor(max_workers=min(self.endpoint.concurrency, len(todo))) as pool:
                got = dict(zip(todo, pool.map(one, todo.values())))
        for k, v in got.items():
            if v.error is None:
                self.cache.put(k, v.value)
        self.cache.save()
        return [got[k] if k in got else Verdict(self.cache.get(k), None, True) for k in keys]

    def _one(self, prompt: list[dict[str, str]], parse: Callable[[str], Any]) -> Verdict:
        try:
            reply = self.client.complete(prompt)
        except JudgeFailure as f:
            return Verdict(None, f"{f.reason}: {f.detail}")
        try:
            return Verdict(parse(reply))
        except ValueError as e:
            return Verdict(None, f"judge_unparsable_score: {e}")


def apply_judge(trajs: Sequence[Trajectory], judge: Judge, weight: float) -> None:
    """Judge every scored episode with a sampled token and add the component ``judge`` =
    w · score / 10, the other components × (1 − w), ``reward`` their sum (module doc). A
    judgement that fails makes the episode an ``env_error`` (``reward`` None, ``error``
    ``judge: REASON: ...``), never a 0. Env errors and episodes without a sampled token are
    left as they are (they leave the batch anyway); ``verifier_score`` is never changed.

    Raises:
        ValueError: ``weight`` outside (0, 1].
    """
    if not 0.0 < weight <= 1.0:
        raise ValueError(f"--judge-weight must lie in (0, 1], got {weight}")
    todo = [t for t in trajs if credited(t)]
    parts = [episode_parts(t) for t in todo]
    prompts = [pointwise_messages(judge.rubric, *p) for p in parts if p is not None]
    verdicts = iter(judge.ask(prompts, parse_score))
    for t, p in zip(todo, parts):
        v = next(verdicts) if p is not None else Verdict(None, "judge_no_response: no reply of the policy to judge")
        if v.error is not None:
            t.reward, t.reward_components, t.outcome, t.error = None, {}, "env_error", f"judge: {v.error}"
            continue
        comps = {k: (1.0 - weight) * x for k, x in t.reward_components.items()}
        comps[JUDGE_COMPONENT] = weight * float(v.value) / SCORE_HIGH
        t.reward_components, t.reward = comps, math.fsum(comps.values())


def judge_metrics(trajs: Sequence[Trajectory], weight: float) -> dict[str, Any]:
    """``judge_score_mean``: mean score / 10 over the judged episodes (None when none was);
    ``judge_errors``: episodes the judge made env_errors."""
    got = [t.reward_components[JUDGE_COMPONENT] for t in trajs if JUDGE_COMPONENT in t.reward_components]
    return {
        "judge_score_mean": math.fsum(got) / (weight * len(got)) if got else None,
        "judge_errors": sum(t.outcome == "env_error" and (t.error or "").startswith("judge:") for t in trajs),
    }


# ---- from the settings ---------------------------------------------------------------------------
def endpoint_of(cfg: Any) -> JudgeEndpoint:
    """The endpoint of a ``TrainConfig``'s ``--judge-*`` settings (``judge_url`` set)."""
    return JudgeEndpoint(
        url=cfg.judge_url,
        model=cfg.judge_model,
        api_key_env=cfg.judge_api_key_env,
        timeout_s=cfg.judge_timeout,
        retries=cfg.judge_retries,
        concurrency=cfg.judge_concurrency,
    )


def judge_record(cfg: Any, env: Any) -> dict[str, Any]:
    """What the manifest records of the judge: server, model, the hashes of the prompt template
    and the rubric, the score format and the settings (the key's variable name, never the key).

    Raises:
        ValueError: as :func:`resolve_rubric`.
    """
    rubric, source = resolve_rubric(cfg.judge_rubric, env)
    return {
        "url": judge_base_url(cfg.judge_url),
        "model": cfg.judge_model,
        "prompt_template_sha256": PROMPT_TEMPLATE_SHA256,
        "rubric_sha256": _sha(rubric),
        "rubric_source": source,
        "score": f"last line `SCORE: x`, 0 ≤ x ≤ {SCORE_HIGH:g}; component {JUDGE_COMPONENT} = w·x/{SCORE_HIGH:g}",
        "weight": cfg.judge_weight,
        "sampling": {"temperature": 0.0, "seed": 0, "max_tokens": endpoint_of(cfg).max_tokens},
        "concurrency": cfg.judge_concurrency,
        "retries": cfg.judge_retries,
        "timeout_s": cfg.judge_timeout,
        "api_key_env": cfg.judge_api_key_env,
        "cache": CACHE_FILE,
    }


def check_judge(cfg: Any, env: Any) -> None:
    """Before any work: the rubric can be read and the judge's server answers with the model.

    Raises:
        ValueError: as :func:`resolve_rubric` and :func:`~consequence.reward.judge_client.probe_judge`.
    """
    resolve_rubric(cfg.judge_rubric, env)
    probe_judge(endpoint_of(cfg))


def judge_reward(cfg: Any, env: Any) -> Callable[[list[Trajectory]], None]:
    """``--judge-url``: the function that judges a round's scored episodes (:func:`apply_judge`),
    its cache kept in the run folder (``judge_cache.json``)."""
    rubric, _ = resolve_rubric(cfg.judge_rubric, env)
    judge = Judge(endpoint_of(cfg), rubric, JudgeCache(Path(cfg.run_dir) / CACHE_FILE))
    return lambda trajs: apply_judge(trajs, judge, cfg.judge_weight)
