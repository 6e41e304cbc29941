"""The run's header lines (``recipes.runner.training.report.header``)."""

import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard

from recipes.charlm.recipe import Config
from recipes.runner.training.report import header


class TinyNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block, self.head = nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x):
        return self.head(self.block(x))


def test_the_model_line_names_the_recipes_class_under_fsdp_too(tmp_path):
    config = Config(device="cpu", epochs=1)
    model = TinyNet()
    assert "  model    TinyNet, 30 parameters" in header("charlm", config, tmp_path, (8, 2), model)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    try:
        fully_shard(model.block)
        fully_shard(model)  # FSDP2 turns the class into FSDPTinyNet
        assert type(model).__name__ == "FSDPTinyNet"
        lines = header("charlm", config, tmp_path, (8, 2), model)
    finally:
        dist.destroy_process_group()
    assert "  model    TinyNet, 30 parameters" in lines
