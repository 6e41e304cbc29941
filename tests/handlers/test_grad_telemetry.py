import copy
import logging
import sys

import pytest
import torch
from ignite.engine import Events
from torch import nn

from engine.nonfinite import NonFiniteGuard, PendingStep
from engine.precision import resolve_precision
from engine.trainer import Trainer, create_trainer
from handlers.grad_telemetry import GradientTelemetry

# One entry per micro-batch. A window's last micro-batch carries the step's pre-clip norm
# (max_grad_norm is 1: the telemetry works out the post-clip norm and the clip); "skip"
# marks a skipped step.
SCRIPT = [
    {"loss": 1.0},
    {"loss": 3.0, "grad_norm": 0.5},
    {"loss": 2.0, "grad_norm": 2.0},
    {"loss": 4.0, "grad_norm": 4.0},
    {"loss": 9.0, "grad_norm": float("nan"), "skip": True},
    {"loss": 6.0, "grad_norm": 1.0},
]


class ScriptedGate:
    """Stands in for the update gate: the script says whether the step was applied."""

    applied = True

    def finite(self) -> bool:
        return self.applied


def scripted_trainer(script, max_grad_norm=1.0, scale=None):
    """A Trainer whose step replays ``script`` by iteration number; its steps settle as the
    real trainer's do, at the next micro-batch or the epoch's end."""
    model = nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    gate = ScriptedGate()
    guard = NonFiniteGuard(gate, {}, "skip", max_consecutive_skips=3)

    def step(engine, batch):
        entry = script[engine.state.iteration - 1]
        output = {key: torch.tensor(value) for key, value in entry.items() if key != "skip"}
        if "grad_norm" in output:
            if scale is not None:
                output["scale"] = torch.tensor(scale)
            gate.applied = not entry.get("skip")
            guard.pending = PendingStep(engine.state.iteration, output, torch.zeros(0), [], [])
        return output

    scaler = torch.amp.GradScaler("cpu", enabled=False)
    # It accumulates (its first window has two micro-batches): accum_steps says so.
    return Trainer(
        step, model, optimizer, scaler, resolve_precision("fp32"), 2, max_grad_norm, guard
    )


def run_with_reports(trainer, telemetry, data):
    reports = []
    telemetry.attach(trainer)
    telemetry.add_listener(reports.append)
    trainer.run(data, max_epochs=1)
    return reports


def test_interval_stats_equal_the_hand_computed_ones(caplog):
    caplog.set_level(logging.INFO, logger="handlers")
    trainer = scripted_trainer(SCRIPT, scale=1024.0)
    reports = run_with_reports(trainer, GradientTelemetry(log_every=2), range(6))

    assert [r.step for r in reports] == [2, 4]
    assert reports[0].stats == pytest.approx({
        "loss_mean": (1 + 3 + 2) / 3, "lr": 0.5, "grad_norm_mean": 1.25, "grad_norm_max": 2.0,
        "grad_norm_clipped_mean": 0.75, "clip_fraction": 0.5, "skipped_steps": 0.0,
        "amp_scale": 1024.0,
    })
    assert reports[1].stats == pytest.approx({
        "loss_mean": (4 + 9 + 6) / 3, "lr": 0.5, "grad_norm_mean": 2.5, "grad_norm_max": 4.0,
        "grad_norm_clipped_mean": 1.0, "clip_fraction": 0.5, "skipped_steps": 1.0,
        "amp_scale": 1024.0,
    })
    assert said(caplog) == [
        "grad health: 50.0% of 4 steps clipped, 1 skipped, median norm 1.5, max 4"
    ]


@pytest.mark.parametrize("norms", [[0.25, 0.75], [0.25, 1.0 - 1e-7], [0.25, 1.0], [0.5, 3.0]],
                         ids=["far_below", "a_hair_below", "at", "above"])
def test_post_clip_norms_follow_the_steps_formula_at_and_near_the_clip(norms):
    # Just below max_grad_norm=1, the 1e-6 guard of clip_grad_norm_ still scales the
    # gradients by a hair: a norm is clipped only above the maximum, but its post-clip
    # norm shrinks from 1 - 1e-6 up.
    script = [{"loss": 1.0, "grad_norm": norm} for norm in norms]
    trainer = scripted_trainer([{"loss": 1.0}, *script])
    report = run_with_reports(trainer, GradientTelemetry(log_every=2), range(3))[0]

    pre = torch.tensor(norms).tolist()  # float32, as the step's norms are
    post = [norm * min(1.0, 1.0 / (norm + 1e-6)) for norm in pre]
    assert report.stats["grad_norm_clipped_mean"] == sum(post) / 2
    assert report.stats["grad_norm_mean"] == sum(pre) / 2
    assert report.stats["clip_fraction"] == sum(norm > 1.0 for norm in pre) / 2
    assert (report.stats["grad_norm_clipped_mean"] < report.stats["grad_norm_mean"]) == (
        max(norms) > 1 - 1e-6)


def test_each_groups_lr_is_reported_when_the_groups_differ():
    trainer = scripted_trainer(SCRIPT)
    reports = run_with_reports(trainer, GradientTelemetry(log_every=2), range(6))
    assert not [name for name in reports[0].stats if name.startswith("lr/")]
    trainer = scripted_trainer(SCRIPT)
    trainer.optimizer.add_param_group({"params": [nn.Parameter(torch.zeros(1))], "lr": 0.2,
                                       "name": "muon"})
    reports = run_with_reports(trainer, GradientTelemetry(log_every=2), range(6))
    assert {name: value for name, value in reports[0].stats.items() if "lr" in name} == {
        "lr": 0.5, "lr/0": 0.5, "lr/muon": 0.2}


def test_amp_scale_only_when_the_step_reports_a_scale():
    reports = run_with_reports(scripted_trainer(SCRIPT), GradientTelemetry(log_every=2), range(6))
    assert all("amp_scale" not in report.stats for report in reports)


def test_end_of_run_reports_the_partial_interval_once_even_after_terminate(caplog):
    caplog.set_level(logging.INFO, logger="handlers")
    trainer = scripted_trainer(SCRIPT)
    trainer.add_event_handler(Events.ITERATION_COMPLETED(once=4), lambda e: e.terminate())
    reports = run_with_reports(trainer, GradientTelemetry(log_every=3), range(6))

    assert [r.step for r in reports] == [3]
    assert reports[0].stats["grad_norm_mean"] == pytest.approx((0.5 + 2 + 4) / 3)
    assert len(said(caplog)) == 1 and said(caplog)[0].startswith("grad health:")


def count_host_reads(monkeypatch):
    """Count Tensor -> host conversions made from handlers/grad_telemetry.py itself."""
    reads = []
    for name in ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__"):
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _original=original, _name=name, **kwargs):
            if sys._getframe(1).f_code.co_filename.endswith("grad_telemetry.py"):
                reads.append(_name)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    return reads


def test_one_host_read_per_interval_and_none_in_between(monkeypatch):
    script = [dict(SCRIPT[1], loss=float(i)) for i in range(9)]  # 9 applied steps
    trainer = scripted_trainer(script)
    telemetry = GradientTelemetry(log_every=3)
    telemetry.attach(trainer)
    reads = count_host_reads(monkeypatch)
    reads_after_iteration = []
    trainer.add_event_handler(
        Events.ITERATION_COMPLETED, lambda e: reads_after_iteration.append(len(reads))
    )
    trainer.run(range(len(script)), max_epochs=1)

    # A step's report comes with its settling, at the next micro-batch (the last: at the end).
    assert reads_after_iteration == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert reads == ["tolist"] * 3


def reference_norms(model, data, lr, max_grad_norm):
    """Pre-clip norms and post-clip per-parameter norms of plain SGD with clipping."""
    model = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    pre_clip, per_parameter = [], []
    for x, y in data:
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        pre_clip.append(float(nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)))
        per_parameter.append({n: float(p.grad.norm()) for n, p in model.named_parameters()})
        optimizer.step()
    return pre_clip, per_parameter


def test_real_trainer_norms_layer_norms_and_histogram_match_a_reference_loop():
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    data = [(torch.randn(4, 3), torch.randn(4, 2) * 5) for _ in range(8)]
    pre_clip, per_parameter = reference_norms(model, data, lr=0.1, max_grad_norm=1.0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    trainer = create_trainer(model, optimizer, nn.functional.mse_loss, max_grad_norm=1.0)
    reports = run_with_reports(trainer, GradientTelemetry(2, layer_every=4, top_k_layers=1), data)

    assert [r.step for r in reports] == [2, 4, 6, 8]
    for report, norms in zip(reports, [pre_clip[i : i + 2] for i in (0, 2, 4, 6)], strict=True):
        assert report.stats["grad_norm_mean"] == pytest.approx(sum(norms) / 2, rel=1e-5)
        assert report.stats["grad_norm_max"] == pytest.approx(max(norms), rel=1e-5)
        assert report.stats["clip_fraction"] == sum(n > 1.0 for n in norms) / 2
    assert [bool(r.top_layer_norms) for r in reports] == [False, True, False, True]
    for report, step in ((reports[1], 4), (reports[3], 8)):
        largest = max(per_parameter[step - 1].items(), key=lambda item: item[1])
        assert report.top_layer_norms == pytest.approx(dict([largest]), rel=1e-5)
        assert report.grad_norms == pytest.approx(pre_clip[step - 4 : step], rel=1e-5)


@pytest.mark.parametrize("accum_steps", [1, 2])
def test_every_micro_batch_loss_counts_applied_or_skipped(accum_steps):
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    trainer = create_trainer(model, torch.optim.SGD(model.parameters(), lr=0.1),
                             nn.functional.mse_loss, accum_steps=accum_steps)
    vetoes = iter([False, True, False])  # the second window is held back: a finite skip
    trainer.set_step_veto(lambda losses, norm: torch.tensor(next(vetoes)))
    losses = []
    trainer.add_event_handler(Events.ITERATION_COMPLETED,
                              lambda e: losses.append(float(e.state.output["loss"])))
    data = [(torch.randn(4, 3), torch.randn(4, 2)) for _ in range(3 * accum_steps)]
    reports = run_with_reports(trainer, GradientTelemetry(log_every=2), data)
    assert trainer.state.skipped_steps == 1 and [r.step for r in reports] == [2]
    assert reports[0].stats["loss_mean"] == pytest.approx(sum(losses) / len(losses))


def test_the_layer_hook_is_on_the_optimizer_only_for_layer_steps():
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    trainer = create_trainer(model, optimizer, nn.functional.mse_loss)
    hooked = []  # at each micro-batch's start, once the previous step has settled
    trainer.add_event_handler(Events.ITERATION_STARTED,
                              lambda e: hooked.append(len(optimizer._optimizer_step_pre_hooks)))
    data = [(torch.randn(4, 3), torch.randn(4, 2)) for _ in range(8)]
    reports = run_with_reports(trainer, GradientTelemetry(2, layer_every=4), data)
    assert hooked == [0, 0, 0, 1, 0, 0, 0, 1]
    assert [bool(r.top_layer_norms) for r in reports] == [False, True, False, True]


def test_fp16_trainer_reports_the_scale_and_fp32_does_not():
    def first_report(precision):
        torch.manual_seed(0)
        model = nn.Linear(3, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        trainer = create_trainer(model, optimizer, nn.functional.mse_loss, precision=precision)
        telemetry = GradientTelemetry(log_every=2)
        # The scale of the step, read when the report is made (an applied step leaves it alone).
        telemetry.add_listener(lambda report: scales.append(trainer.scaler.get_scale()))
        scales = []
        data = [(torch.randn(4, 3), torch.randn(4, 1))] * 12
        report = run_with_reports(trainer, telemetry, data)[0]
        return report, scales[0], trainer.state.skipped_steps

    report, scale, skipped = first_report("fp16")
    assert skipped > 0  # GradScaler starts at 2**16 and backs off through overflows
    assert report.stats["amp_scale"] == scale == 2.0 ** 16 / 2**skipped
    assert report.stats["skipped_steps"] == skipped
    assert "amp_scale" not in first_report("fp32")[0].stats


def test_state_roundtrip_resumes_with_identical_reports(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="handlers")
    script = SCRIPT + [dict(SCRIPT[1], loss=5.0), dict(SCRIPT[3], loss=7.0), dict(SCRIPT[2])]
    trainer = scripted_trainer(script, scale=8.0)
    uninterrupted = run_with_reports(trainer, GradientTelemetry(log_every=3), range(9))
    health = said(caplog)
    caplog.clear()
    assert [r.step for r in uninterrupted] == [3, 6, 7]  # 7: the partial interval at the end

    first = scripted_trainer(script, scale=8.0)
    first_telemetry = GradientTelemetry(log_every=3)
    first_telemetry.attach(first)

    def save_and_stop(engine):  # mid-interval: one step and two losses accumulated
        engine.settle()  # as a checkpoint at a step's own micro-batch must
        torch.save(first_telemetry.state_dict(), tmp_path / "telemetry.pt")
        torch.save(engine.state_dict(), tmp_path / "trainer.pt")
        engine.terminate()

    first.add_event_handler(Events.ITERATION_COMPLETED(once=6), save_and_stop)
    first.run(range(9), max_epochs=1)
    caplog.clear()
    resumed = scripted_trainer(script, scale=8.0)
    resumed_telemetry = GradientTelemetry(log_every=3)
    resumed_telemetry.load_state_dict(torch.load(tmp_path / "telemetry.pt", weights_only=True))
    resumed.load_state_dict(torch.load(tmp_path / "trainer.pt", weights_only=True))
    after_resume = run_with_reports(resumed, resumed_telemetry, range(9))

    assert after_resume == uninterrupted[1:]
    assert said(caplog) == health and len(health) == 1


def test_load_refuses_a_state_saved_with_another_log_every():
    with pytest.raises(ValueError, match="log_every"):
        GradientTelemetry(log_every=4).load_state_dict(GradientTelemetry(log_every=2).state_dict())


def said(caplog) -> list[str]:
    """What the telemetry logged (its health line)."""
    return [record.getMessage() for record in caplog.records
            if record.name == "handlers.grad_telemetry"]


def health_line(norms, max_grad_norm):
    script = [dict(loss=1.0, grad_norm=n) for n in norms]
    trainer = scripted_trainer(script, max_grad_norm=max_grad_norm)
    telemetry = GradientTelemetry(log_every=2)
    run_with_reports(trainer, telemetry, range(len(script)))
    return telemetry.health_line()


def test_hint_only_when_the_median_norm_sits_far_above_max_grad_norm():
    hint = "norms sit far above max_grad_norm=1: the learning rate is the likelier cause"
    assert hint in health_line([6.0, 7.0, 8.0] * 7, max_grad_norm=1.0)
    assert "far above" not in health_line([0.5, 2.0, 30.0] * 7, max_grad_norm=1.0)  # median 2
    assert "far above" not in health_line([6.0, 7.0, 8.0] * 7, max_grad_norm=None)


def test_no_hint_from_a_few_steps_of_an_untrained_model():
    line = health_line([6.0, 7.0, 8.0], max_grad_norm=1.0)
    assert line.startswith("grad health: 100.0% of 3 steps clipped") and "far above" not in line


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"log_every": 0}, "log_every"),
        ({"log_every": True}, "log_every"),
        ({"log_every": 2, "layer_every": 3}, "layer_every"),
        ({"log_every": 2, "top_k_layers": 0}, "top_k_layers"),
    ],
)
def test_rejects_bad_arguments_naming_them(kwargs, name):
    with pytest.raises(ValueError, match=name):
        GradientTelemetry(**kwargs)
