"""--compile: the whole step compiled once, whatever the schedule, the evaluation, the LR scale
or a checkpoint does after the first epoch; a resume as exact as an eager one.

The recompile count is taken with inductor, the backend --compile uses: with dynamo's
``eager`` backend a float LR would not show its recompiles (dynamo makes it a symbolic
float there, which inductor does not take). The other tests compile with the ``eager``
backend, which runs the captured graphs as they are, to finish in seconds; one slow test
repeats the exact resume under inductor."""

import logging

import pytest
import torch
import torch.nn.functional as F
from ignite.engine import Events
from ignite.metrics import Accuracy
from torch._dynamo.utils import counters

import engine.trainer
from engine.compiled_step import DELIBERATE, CompiledUpdate, report_graph_breaks
from engine.muon import Muon
from engine.trainer import create_evaluator, create_trainer
from engine.update_gate import MaskedGate
from handlers.lookahead import Lookahead
from handlers.lr_scheduling import build_scheduler

EPOCHS, BATCHES = 3, 4


@pytest.fixture
def eager_backend(monkeypatch):
    """torch.compile (nn.Module.compile's too) with dynamo's ``eager`` backend."""
    real = torch.compile

    def compile_eagerly(model=None, **options):
        options.pop("mode", None)
        return real(model, backend="eager", **options)

    monkeypatch.setattr(torch, "compile", compile_eagerly)
    torch._dynamo.reset()


def graphs_compiled() -> int:
    """Graphs dynamo has captured in this process (a recompile captures one more)."""
    return counters["stats"]["unique_graphs"]


def fallbacks() -> int:
    """Graph breaks so far, less those code asks for (torch.optim's, around its step)."""
    return sum(count for reason, count in counters["graph_break"].items()
               if not reason.startswith(DELIBERATE))


def limits_hit() -> int:
    """Times dynamo gave up compiling a frame again and ran it eagerly from then on."""
    return sum(count for reason, count in counters["unimplemented"].items()
               if "recompile limit" in reason)


def muon(model: torch.nn.Module) -> Muon:
    """The first layer's weight by Muon, the rest by SGD: both kinds of update compiled."""
    first = model[0].weight
    rest = [p for p in model.parameters() if p is not first]
    return Muon([{"params": [first], "use_muon": True, "lr": 0.04, "momentum": 0.85},
                 {"params": rest}], lr=0.1, momentum=0.9)


OPTIMIZERS = {
    "muon": muon,
    "muon with adamw": lambda model: Muon(
        [{"params": [model[0].weight], "use_muon": True, "lr": 0.04, "momentum": 0.85},
         {"params": [p for p in model.parameters() if p is not model[0].weight]}],
        lr=0.01, other="adamw"),
    "sgd": lambda model: torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9,
                                         nesterov=True),
    "adamw": lambda model: torch.optim.AdamW(model.parameters(), lr=0.01),
}


def build(make_mlp, compile: bool = True, optimizer: str = "muon",
          schedule: str = "warmup_cosine"):
    model = make_mlp()
    optimizer = OPTIMIZERS[optimizer](model)
    trainer = create_trainer(model, optimizer, F.cross_entropy, compile=compile,
                             max_grad_norm=1.0)
    scheduler = build_scheduler(schedule, optimizer, steps_per_epoch=BATCHES, epochs=EPOCHS,
                                warmup_epochs=1 if schedule == "warmup_cosine" else 0)
    scheduler.attach(trainer)
    return model, optimizer, trainer, scheduler


def state(model, optimizer, trainer, schedule) -> dict:
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
            "trainer": trainer.state_dict(), "schedule": schedule.state_dict()}


# Each schedule changes a value at every step: warmup_cosine the LR; onecycle the LR and
# momentum, which it cycles as betas[0] where the optimizer has betas (AdamW, and Muon, whose
# defaults hold them) and as momentum elsewhere (SGD).
# The masked gate is CUDA's (it clones and puts back the state around the step), run here on
# the CPU (its constructor takes make_gate's arguments).
@pytest.mark.parametrize("optimizer, schedule, gate", [
    ("muon", "warmup_cosine", "host"), ("muon with adamw", "onecycle", "host"),
    ("sgd", "onecycle", "host"), ("adamw", "onecycle", "host"),
    ("muon", "warmup_cosine", "masked"), ("adamw", "onecycle", "masked")])
def test_nothing_compiles_again_after_the_first_epoch(optimizer, schedule, gate, make_mlp,
                                                      make_batches, tmp_path, monkeypatch):
    torch._dynamo.reset()
    if gate == "masked":
        monkeypatch.setattr(engine.trainer, "make_gate", MaskedGate)
    model, optimizer, trainer, schedule = build(make_mlp, optimizer=optimizer,
                                                schedule=schedule)
    Lookahead(model, total_steps=EPOCHS * BATCHES, every=2).attach(trainer)
    evaluator = create_evaluator(model, {"accuracy": Accuracy()})
    data = make_batches(BATCHES)
    trainer.add_event_handler(Events.EPOCH_COMPLETED, lambda _: evaluator.run(data[:2]))
    after_first_epoch = {}

    @trainer.on(Events.EPOCH_COMPLETED)
    def save_then_resume_and_scale(engine) -> None:
        # Handlers run in order: the evaluation above has compiled its graph by now.
        if engine.state.epoch == 1:
            after_first_epoch["graphs"] = graphs_compiled()
        path = tmp_path / "checkpoint.pt"
        torch.save(state(model, optimizer, engine, schedule), path)
        saved = torch.load(path, weights_only=True)
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        schedule.load_state_dict(saved["schedule"])
        engine.set_lr_scale(0.5 if engine.state.epoch == 1 else 1.0)

    breaks, limits = fallbacks(), limits_hit()
    trainer.run(data, max_epochs=EPOCHS)
    assert trainer.state.optimizer_step == EPOCHS * BATCHES
    assert graphs_compiled() - after_first_epoch["graphs"] == 0
    assert limits_hit() == limits  # not by running eagerly instead
    assert fallbacks() == breaks  # the step compiled whole


def test_the_optimizer_keeps_float_lrs_that_round_trip_weights_only(eager_backend, make_mlp,
                                                                   make_batches, tmp_path):
    model, optimizer, trainer, _ = build(make_mlp)
    trainer.run(make_batches(BATCHES), max_epochs=1)
    assert all(type(group["lr"]) is float for group in optimizer.param_groups)
    path = tmp_path / "optimizer.pt"
    torch.save(optimizer.state_dict(), path)
    fresh = muon(make_mlp())
    fresh.load_state_dict(torch.load(path, weights_only=True))
    assert [g["lr"] for g in fresh.param_groups] == [g["lr"] for g in optimizer.param_groups]


def run_to_the_end(make_mlp, data, saved: dict | None, epochs: int):
    model, optimizer, trainer, schedule = build(make_mlp)
    if saved is not None:
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        trainer.load_state_dict(saved["trainer"])
        schedule.load_state_dict(saved["schedule"])
    trainer.run(data, max_epochs=epochs)
    return state(model, optimizer, trainer, schedule)


def assert_resume_is_exact(make_mlp, make_batches, tmp_path) -> None:
    data = make_batches(BATCHES)
    whole = run_to_the_end(make_mlp, data, None, EPOCHS)
    torch.save(run_to_the_end(make_mlp, data, None, EPOCHS - 1), tmp_path / "c.pt")
    resumed = run_to_the_end(make_mlp, data, torch.load(tmp_path / "c.pt", weights_only=True),
                             EPOCHS)
    for name, value in whole["model"].items():
        assert torch.equal(value, resumed["model"][name]), name
    for key, value in whole["optimizer"]["state"].items():
        for name, tensor in value.items():
            assert torch.equal(tensor, resumed["optimizer"]["state"][key][name]), name


def test_a_compiled_resume_is_bit_identical(eager_backend, make_mlp, make_batches, tmp_path):
    assert_resume_is_exact(make_mlp, make_batches, tmp_path)


@pytest.mark.slow  # inductor compiles for tens of seconds on a small CPU
def test_a_compiled_resume_is_bit_identical_with_inductor(make_mlp, make_batches, tmp_path):
    torch._dynamo.reset()
    assert_resume_is_exact(make_mlp, make_batches, tmp_path)


def test_the_compiled_update_equals_the_eager_one(eager_backend, make_mlp, make_batches):
    eager, compiled = make_mlp(), make_mlp()
    updates = [muon(eager).step, CompiledUpdate(muon(compiled), torch.device("cpu"))]
    for model, update in zip((eager, compiled), updates, strict=True):
        for x, y in make_batches(3):
            F.cross_entropy(model(x), y).backward()
            update()
            model.zero_grad(set_to_none=True)
    for got, want in zip(compiled.parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


def test_a_graph_break_is_reported_in_one_line(eager_backend, caplog):
    @torch.compile
    def asks_for_a_break(x: torch.Tensor) -> torch.Tensor:
        torch._dynamo.graph_break()  # as torch.optim's step does: not reported
        return x + 1

    @torch.compile
    def breaks(x: torch.Tensor) -> torch.Tensor:
        return x * x.sum().item()  # a host number: dynamo cannot trace it

    def reported() -> list[logging.LogRecord]:
        return [r for r in caplog.records if r.name == "engine.compiled_step"]

    before = dict(counters["graph_break"])
    with caplog.at_level(logging.WARNING):
        asks_for_a_break(torch.ones(2))
        report_graph_breaks(before)
        assert not reported()  # none yet: nothing to say
        breaks(torch.ones(2))
        report_graph_breaks(before)
    (record,) = reported()
    assert record.getMessage().startswith("compile: the step fell back to eager at 1 graph ")
    assert "Tensor.item()" in record.getMessage()
    assert "\n" not in record.getMessage()


def test_cuda_graphs_need_compile_and_cuda(make_mlp):
    model = make_mlp()
    with pytest.raises(ValueError, match=r"cuda_graphs=True needs compile=True and a CUDA"):
        create_trainer(model, muon(model), F.cross_entropy, compile=True, cuda_graphs=True)
    with pytest.raises(ValueError, match=r"cuda_graphs must be True or False"):
        create_trainer(model, muon(model), F.cross_entropy, cuda_graphs="yes")


@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="CUDA graphs are recorded on a CUDA device only; none here")
def test_cuda_graphs_train_like_eager_without_compiling_again(make_mlp, make_batches):
    torch._dynamo.reset()
    data = [(x.cuda(), y.cuda()) for x, y in make_batches(BATCHES)]
    models = []
    for graphs in (False, True):
        model = make_mlp().cuda()
        trainer = create_trainer(model, muon(model), F.cross_entropy, device="cuda",
                                 precision="fp32", compile=graphs, cuda_graphs=graphs)
        trainer.run(data, max_epochs=1)
        before = graphs_compiled()
        trainer.run(data, max_epochs=EPOCHS)
        assert graphs_compiled() == before
        models.append(model)
    for got, want in zip(models[1].parameters(), models[0].parameters(), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
