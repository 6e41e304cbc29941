import torch
from ignite.engine import Engine

from benchmarks.arms.workloads import tiny_workload
from benchmarks.sections.s2_syncs import SYNC_METHODS, SyncCounter, count_run, step_only


def test_counts_each_planted_sync_with_its_call_site():
    x = torch.ones(3)
    with SyncCounter() as counter:
        x.sum().item()
        float(x[0])
        bool(x.any())
        int(x[1])
        x.tolist()
        x.numpy()
        x.cpu()
        [10, 20][torch.tensor(1)]  # __index__
    methods = [call.method for call in counter.calls]
    assert methods == ["item", "__float__", "__bool__", "__int__", "tolist", "numpy", "cpu",
                       "__index__"]
    assert counter.calls[0].site.startswith("tests/benchmarks/sections/test_s2_syncs.py:")


def test_arithmetic_on_the_device_is_not_a_sync():
    x = torch.ones(3)
    with SyncCounter() as counter:
        y = (x * 2).sum() + torch.isfinite(x).all()
        torch.stack([y, y])
    assert counter.calls == []


def test_formatting_a_tensor_counts_at_the_caller():
    with SyncCounter() as counter:
        f"{torch.tensor(1.5):.2f}"  # torch's Tensor.__format__ calls item()
    assert [call.method for call in counter.calls] == ["item"]
    assert counter.calls[0].site.startswith("tests/benchmarks/sections/test_s2_syncs.py:")


def test_methods_are_restored_on_exit():
    before = {name: getattr(torch.Tensor, name) for name in SYNC_METHODS}
    with SyncCounter():
        assert torch.Tensor.item is not before["item"]
    assert {name: getattr(torch.Tensor, name) for name in SYNC_METHODS} == before
    assert not any(name in torch.Tensor.__dict__ for name in ("item", "__bool__"))
    assert torch.ones(1).item() == 1.0


def test_count_run_attributes_syncs_to_iterations():
    def step(engine, batch):
        if engine.state.iteration % 2 == 0:
            batch.item()

    engine = Engine(step)
    batches = [torch.tensor(float(i)) for i in range(4)]
    counter = count_run(engine, batches)
    with counter:
        engine.run(batches, max_epochs=1)
    assert [len(counter.at(i)) for i in (1, 2, 3, 4)] == [0, 1, 0, 1]


def test_the_step_never_syncs_not_even_at_an_optimizer_step():
    scenario = step_only(tiny_workload(0, 8), accum_steps=4)
    inside, closing = scenario.categories.values()
    assert [len(scenario.counter.at(i)) for i in inside + closing] == [0] * 8
    assert scenario.counter.calls == []  # nor at the epoch's or the run's end
