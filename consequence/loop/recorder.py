"""Everything a training run writes, behind one object (:class:`RunRecorder`).

The run folder (docs/resume.md): ``config.yaml`` and ``split.json`` at the start;
``manifest.json``, updated as the run goes, with its ``status`` written on every exit path;
``trajectories/iter_*.parquet``; one ``metrics.jsonl`` line per iteration; a checkpoint of
each validated policy; a resume state every ``checkpoint_every`` iterations; and at the end
``report.json``, ``report.md`` and ``curves.png``. The progress bar is the recorder's too.
"""

from __future__ import annotations

import errno
import json
import signal
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal

import yaml
from rich.markup import escape

from consequence.fileio import append_line, write_text_atomic
from consequence.loop.checks import PreStepCheckError
from consequence.loop.diagnostics import first_step_ratio_tol, warnings_for
from consequence.loop.resume import mark_status, rewind_run_dir, save_state
from consequence.policy.checkpoint import save_policy
from consequence.records import Trajectory, write_trajectories
from consequence.report.manifest import clear_run_outputs, write_manifest
from consequence.report.trackers import ARTIFACTS, Trackers, open_trackers
from consequence.scale.scheduler import RolloutError

# A write that fails with one of these stops the run cleanly (RunStopped); others propagate.
WRITE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EIO}


class Terminated(KeyboardInterrupt):
    """SIGTERM (a job scheduler's stop, ``kill``, a container shutdown) during a run: handled
    like Ctrl-C, so the run ends ``interrupted`` and resumable instead of dying as ``running``."""


def _raise_terminated(signum, frame) -> None:
    raise Terminated()


def run_ending(e: BaseException | None) -> tuple[str, str | None]:
    """How a run that ended with ``e`` (None: it returned) is recorded in manifest.json:
    ``(status, stop_reason)``, one of

    - ``finished``: the run returned (final checkpoint, evaluation, report written); no reason;
    - ``interrupted``: Ctrl-C / SIGINT (KeyboardInterrupt), or SIGTERM (:class:`Terminated`);
    - ``stopped``: a clean stop the run foresees, resumable once the cause is gone: a failed
      pre-step check, a NaN / ±inf in an update, the rollout workers' error, a failed write
      (disk full, read-only, ...: :data:`WRITE_ERRNOS`);
    - ``refused``: bad input found only after the run started (a ValueError, the library's
      error for a user's input, e.g. a chat template that re-renders earlier turns,
      docs/cases.md, case 08); the reason is its message;
    - ``failed``: anything else (a crash: a bug, or a plug-in that raised); the reason is
      ``"ExceptionType: message"``.
    """
    if e is None:
        return "finished", None
    if isinstance(e, Terminated):
        return "interrupted", "terminated (SIGTERM)"
    if isinstance(e, KeyboardInterrupt):
        return "interrupted", "interrupted (Ctrl-C / SIGINT)"
    if isinstance(e, (PreStepCheckError, FloatingPointError, RolloutError)) or (
        isinstance(e, OSError) and e.errno in WRITE_ERRNOS
    ):
        return "stopped", str(e)
    if isinstance(e, ValueError):
        return "refused", str(e)
    return "failed", f"{type(e).__name__}: {e}"


class RunRecorder:
    """The run folder of one training run, and its progress bar.

    Used as a context manager around the whole run: on every exit path (return, Ctrl-C,
    SIGTERM, a foreseen stop, bad input found late, a crash) it writes ``status`` and
    ``stop_reason`` (:func:`run_ending`) into manifest.json, then lets the exception go on.
    It writes them only once this run's manifest exists (:meth:`open`): an error before
    that leaves the folder, and the manifest of an earlier run in it, as they were.

    Attributes:
        dir: the run folder.
        manifest: the run's manifest (written by :meth:`save_manifest`).
        history: the metrics of the iterations completed, in order (with a resumed run's).
        show: displays the phase in progress on the progress bar (inside :meth:`iterations`).
    """

    def __init__(self, run_dir: Path, console):
        self.dir, self.console = run_dir, console
        self.manifest: dict[str, Any] = {}
        self.history: list[dict[str, Any]] = []
        self.opened = False
        self.show: Callable[[str], None] = lambda text: None
        self._sigterm: Any = None  # the SIGTERM handler to put back (signal.signal returns any kind)
        self.trackers = Trackers()  # --report-to: started by start_trackers

    # ---- the run's ending ----------------------------------------------------------------
    def __enter__(self) -> RunRecorder:
        if threading.current_thread() is threading.main_thread():  # signal handlers live in the main thread
            self._sigterm = signal.signal(signal.SIGTERM, _raise_terminated)
        return self

    def __exit__(self, kind, e, tb) -> Literal[False]:
        if self._sigterm is not None:
            signal.signal(signal.SIGTERM, self._sigterm)
        if self.opened:
            status, reason = run_ending(e)
            self.trackers.close(status)  # the tracker runs end as the run does (a tracker's error only warns)
            # "finished" must not be lost silently: a failed write there raises (and is a stopped run)
            mark_status(self.dir, status, reason, strict=e is None)
        return False  # the exception, if any, goes on

    # ---- the start -----------------------------------------------------------------------
    def clear_earlier_run(self) -> None:
        """Delete an earlier run's outputs in the folder (other files are kept), saying so."""
        cleared = clear_run_outputs(self.dir)
        if cleared:
            self.console.print(f"{self.dir} held an earlier run: deleted its {len(cleared)} outputs (other files kept)")

    def write_config(self, config: dict[str, Any]) -> None:
        """config.yaml: the settings nested by box (``TrainConfig.nested_dump``)."""
        write_text_atomic(self.dir / "config.yaml", yaml.safe_dump(config, sort_keys=False))

    def write_cold_start(self, record: dict[str, Any]) -> None:
        """cold_start.json: the cold start RL starts from (``loop.start_model.cold_started``)."""
        write_text_atomic(self.dir / "cold_start.json", json.dumps(record, indent=1))

    def write_split(self, problem_ids: Any) -> None:
        write_text_atomic(self.dir / "split.json", json.dumps(problem_ids))

    def open(self, start: int) -> None:
        """Drop what iterations ≥ ``start`` left (a resumed run), write the manifest; from now
        on the run's ending is recorded in it."""
        rewind_run_dir(self.dir, start, self.history)
        self.save_manifest()
        self.opened = True

    def save_manifest(self) -> None:
        write_manifest(self.manifest, self.dir)

    def start_trackers(self, names: Sequence[str], config: dict[str, Any], start: int) -> None:
        """``--report-to``: start the trackers (a resumed run, ``start`` > 0, continues their
        runs; ``report.trackers.open_trackers``) and say where each writes.

        Raises:
            ValueError: a tracker could not start its run.
        """
        warn = lambda text: self.console.print(f"[yellow]warning:[/] {escape(text)}")  # noqa: E731
        self.trackers = open_trackers(names, self.dir, config, start, warn)
        if self.trackers:
            self.console.print(f"tracking: {escape(self.trackers.describe())}")

    # ---- the iterations ------------------------------------------------------------------
    @contextmanager
    def progress(self, label: str, start: int, total: int) -> Iterator[Callable[[int, str], None]]:
        """The progress bar of iterations ``start`` … ``total − 1``; yields ``done(it, status)``,
        which advances it. Inside, :attr:`show` displays a phase and :attr:`console` prints
        above the bar."""
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

        outer = self.console
        with Progress(
            TextColumn("[progress.description]{task.description}"),
            BarColumn(),
            TextColumn("{task.completed}/{task.total}"),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            TextColumn("{task.fields[status]}"),
            console=outer,
        ) as bar:
            job = bar.add_task(escape(label), total=total, completed=start, status="")
            self.show = lambda text: bar.update(job, status=text)

            def done(it: int, status: str) -> None:
                bar.update(job, advance=1, status=status)
                if not outer.is_terminal:  # logs and pipes get one line per iteration instead
                    outer.print(f"iteration {it} ({it + 1}/{total} done)  {status}")

            self.console = bar.console
            try:
                yield done
            finally:
                self.console, self.show = outer, lambda text: None

    def trajectories(self, it: int, trajs: list[Trajectory]) -> None:
        write_trajectories(self.dir / "trajectories" / f"iter_{it:04d}.parquet", trajs)

    def checkpoint(self, model, tokenizer, name: str) -> None:
        """A policy checkpoint in ``checkpoints/NAME`` (a LoRA run's holds its adapter)."""
        save_policy(model, tokenizer, self.dir / "checkpoints" / name)

    def record(self, it: int, m: dict[str, Any]) -> None:
        """Iteration ``it``'s metrics: the pre-step checks' results into the manifest, the
        warnings the history raises (printed and kept in the line), one metrics.jsonl line."""
        if "pre_step_checks" in m:
            self.manifest["checks"]["results"] = m.pop("pre_step_checks")
            self.save_manifest()
        self.history.append(m)
        m["warnings"] = warnings_for(self.history, first_step_ratio_tol(self.manifest))
        for w in m["warnings"]:
            self.console.print(f"[yellow]warning (iteration {it}):[/] {w}")
        append_line(self.dir / "metrics.jsonl", json.dumps(m, allow_nan=False))  # strict JSON: a NaN here is a bug
        self.trackers.log(it, m)  # --report-to: the same line, after metrics.jsonl has it

    def resume_state(self, completed: int, learner, tokenizer, config: dict[str, Any]) -> None:
        """A resume state after ``completed`` iterations (``loop.resume.save_state``)."""
        save_state(self.dir, completed, learner, tokenizer, self.history, self.manifest, config)

    # ---- the end -------------------------------------------------------------------------
    def report(self, report: dict[str, Any], skipped: str | None) -> None:
        """report.json, the manifest's pointers to it and the evaluation files, curves.png and
        report.md (headed by ``skipped`` when the final evaluation did not run); prints report.md."""
        write_text_atomic(self.dir / "report.json", json.dumps(report, indent=2))
        # status "finished" is written by __exit__ once everything below was written too
        self.manifest.update(evaluation_files=report.pop("evaluation_files", []), report="report.json")
        self.save_manifest()
        from consequence.report.plots import plot_metrics, write_markdown_report

        plot_metrics(self.dir / "metrics.jsonl", self.dir / "curves.png")
        md = self.dir / "report.md"
        write_markdown_report(report, md)
        if skipped:  # say so at the top of report.md, not only as an empty table
            title, _, rest = md.read_text().partition("\n")
            write_text_atomic(
                md,
                f"{title}\n\n**{skipped[0].upper() + skipped[1:]}**: the warm start "
                f"and the RL checkpoint were not compared.\n{rest}",
            )
        self.trackers.log_artifacts([self.dir / name for name in ARTIFACTS])
        self.console.print(md.read_text())


def is_write_error(e: BaseException) -> bool:
    """An OSError of a failed write that stops the run cleanly (:data:`WRITE_ERRNOS`)."""
    return isinstance(e, OSError) and e.errno in WRITE_ERRNOS
