"""The console step line and its ETA (``etude.report.metrics``): what a job's log file shows when
no progress bar is drawn."""

from __future__ import annotations

from etude.report.metrics import StepClock, format_duration, format_step_line


def test_step_line_carries_the_total_and_the_eta() -> None:
    line = format_step_line(
        120, {"loss": 2.31, "tok/s": 48211.0}, ("loss", "reward", "tok/s"), total=300, eta_s=250
    )
    assert line == "step 120/300 | loss 2.310 | tok/s 48,211 | eta 4m 10s"
    # without them, the line is as before (the report and the tests read old logs)
    assert format_step_line(3, {"loss": 0.5}, ("loss",)) == "step 3 | loss 0.5000"


def test_durations_at_the_precision_that_matters() -> None:
    assert [format_duration(s) for s in (0, 44.6, 61, 3599, 7500)] == [
        "0s",
        "45s",
        "1m 01s",
        "59m 59s",
        "2h 05m",
    ]


def test_clock_paces_a_resumed_loop_from_where_it_resumed() -> None:
    # resumed at step 100 of 300: two steps in 20 s leave 198 steps, 1,980 s
    clock = StepClock(100, 300, now=1000.0)
    assert clock.eta(100, now=1000.0) is None  # no step of this process yet
    assert clock.eta(102, now=1020.0) == 1980.0
    assert clock.eta(300, now=3000.0) == 0.0
