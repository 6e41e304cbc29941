"""Section 7's arithmetic on hand-made sweeps: the targets, the split of the sweep's time
outside its trials, the verdicts on the medians (measuring runs real sweeps: ``make bench``)."""

import pytest

from benchmarks.sections.s7_sweep import SweepResult, render


def _sweep(wall: float, epochs: int = 2) -> SweepResult:
    # Two trials: 1 s of training each, 1.5 s as runs in the sweep, 7.5 s as commands.
    return SweepResult(trials=2, epochs=epochs, wall_seconds=wall, trial_seconds=[1.0, 1.0],
                       in_sweep_seconds=[1.5, 1.5], command_seconds=[7.5, 7.5], load="0.5")


def test_a_sweep_is_split_into_its_runs_the_process_start_and_the_machinery():
    sweep = _sweep(wall=10.0)
    assert sweep.budget(sweep.trial_seconds) == pytest.approx(1.1 * 2 + 2 * 2)
    assert sweep.process_start() == pytest.approx(6.0)  # 7.5 - 1.5, the median
    assert sweep.machinery() == pytest.approx(10.0 - 3.0 - 6.0)


def test_the_verdicts_are_the_medians_of_the_repeats_against_each_target():
    # Targets: 6.2 s on summaries, 7.3 s on runs in the sweep, 20.5 s on commands.
    short = [_sweep(wall) for wall in (6.0, 7.0, 9.0)]  # median 7.0: over, within, within
    longer = [_sweep(wall, epochs=8) for wall in (5.0, 6.0, 30.0)]  # median 6.0: all within
    text = render([short, longer])
    first, second = text.split("### Trials of 2 epochs")[1].split("### Trials of 8 epochs")
    assert "over the target counted on the summaries' run times, within it counted on the " \
           "trials' runs in the sweep, within it counted on their own commands" in first
    assert "Medians of sweep / target: 1.129, 0.959, 0.341" in first
    assert "within the target counted on the summaries' run times" in second
    assert "The trials of the median repeat (7.00 s)" in first
    assert "trials of 2 epochs and 8 epochs, one command, 3 times each" in text
