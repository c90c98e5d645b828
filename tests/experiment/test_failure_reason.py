"""A failed run says why: the exit code, the signal, or what Ray raised when its worker died."""

from __future__ import annotations

from consequence.experiment.run import failure_reason


class OutOfMemoryError(Exception):  # the shape of Ray's: a long message whose first line says it all
    pass


def test_a_signal_is_named_and_sigkill_points_at_memory():
    assert failure_reason(-9) == "the training process was killed by signal SIGKILL (often the out-of-memory killer)"
    assert failure_reason(-15) == "the training process was killed by signal SIGTERM"


def test_an_exit_code_points_at_the_log():
    assert failure_reason(2) == "the training process exited with code 2: its error is at the end of the log"


def test_a_dead_worker_gives_ray_s_first_line_and_a_memory_hint():
    err = OutOfMemoryError("Task was killed due to the node running low on memory.\nMemory on the node was 22 GB")
    assert failure_reason(None, err) == (
        "its Ray worker died: OutOfMemoryError: Task was killed due to the node running low on memory. "
        "(memory: fewer runs at once, i.e. a larger --cpus-per-run)"
    )
    assert failure_reason(None, RuntimeError("worker crashed")) == "its Ray worker died: RuntimeError: worker crashed"
