"""Progress of the long phases of an evaluation (episodes, recovery, visible tests, completions).

On a terminal each phase is a Rich progress bar: done / total, the rate (units per second),
elapsed and remaining time; several phases may run at once (sampling and scoring of
completions overlap). Elsewhere (a log, a pipe, a test runner) each phase prints one line
when it starts and one when it ends, with the counts and the time:

    episodes: start, 40 episodes
    episodes: done, 40/40 episodes in 12.3 s (3.25 episodes/s)

(``interrupted`` instead of ``done`` after Ctrl-C, ``stopped`` after an error.)

Callbacks may be called from any thread. ``Phases(None)`` reports nothing (library use).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.text import Text

Tick = Callable[[int], None]  # tick(done): units finished so far (monotone; larger values win)


class _Rate(ProgressColumn):
    """``3.2 episodes/s`` from Rich's speed estimate (the unit is the task's ``unit`` field)."""

    def render(self, task) -> Text:
        speed = task.finished_speed or task.speed
        return Text(f"{speed:.2f} {task.fields.get('unit', '')}/s" if speed else "—", style="progress.data.speed")


class Phases:
    """Reports phases to ``console`` (None: silent). Use as a context manager around the
    whole command so that concurrent phases share one live display."""

    def __init__(self, console: Console | None):
        self.console = console
        self._bar: Progress | None = None
        self._lock = threading.Lock()

    def __enter__(self) -> Phases:
        if self.console is not None and self.console.is_terminal:
            self._bar = Progress(
                TextColumn("{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                _Rate(),
                TimeElapsedColumn(),
                TimeRemainingColumn(),
                console=self.console,
            )
            self._bar.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None

    @contextmanager
    def phase(self, name: str, total: int, unit: str = "episodes") -> Iterator[Tick]:
        """Yield ``tick(done)`` for a phase of ``total`` units; report its start and end."""
        t0, state = time.perf_counter(), {"done": 0}
        bar = self._bar
        job = bar.add_task(name, total=total, unit=unit) if bar is not None else None
        if bar is None and self.console is not None:
            self.console.print(f"{name}: start, {total} {unit}", markup=False, highlight=False)

        def tick(done: int) -> None:
            with self._lock:
                state["done"] = max(state["done"], int(done))
                if bar is not None and job is not None:  # job is None exactly when bar is
                    bar.update(job, completed=state["done"])

        ended = "done"
        try:
            yield tick
        except KeyboardInterrupt:
            ended = "interrupted"  # Ctrl-C mid-phase: never reported as done (break-test)
            raise
        except BaseException:
            ended = "stopped"
            raise
        finally:
            dt = time.perf_counter() - t0
            if bar is not None and job is not None:
                bar.update(job, completed=state["done"])
            elif self.console is not None:
                rate = state["done"] / dt if dt > 0 else 0.0
                self.console.print(
                    f"{name}: {ended}, {state['done']}/{total} {unit} in {dt:.1f} s ({rate:.2f} {unit}/s)",
                    markup=False,
                    highlight=False,
                )

    def counter(self, tick: Tick) -> Callable[[int], None]:
        """``add(k)``: a thread-safe running count fed to ``tick`` (for units finishing one by one)."""
        count = {"n": 0}
        lock = threading.Lock()

        def add(k: int = 1) -> None:
            with lock:
                count["n"] += k
                n = count["n"]
            tick(n)

        return add


SILENT = Phases(None)
