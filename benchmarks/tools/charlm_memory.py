"""Peak memory of charlm's training step by width, on CPU processes: plain PyTorch (no run
layer), DDP or FSDP2 (``fully_shard`` on each block and the root), with or without activation
checkpointing.

``python -m benchmarks.tools.charlm_memory --widths 256,512,768 --cap-mb 1536``
starts, per width and arm, a fresh group of ``--nproc`` processes (gloo) that build the GPT,
take ``--steps`` AdamW steps on random bytes (the first on one window, to create the
optimizer state; the others on ``--batch`` windows of ``--block-size`` per process) and
report each process's peak RSS (``getrusage``) above its RSS after the imports.
Run it with ``MALLOC_MMAP_THRESHOLD_=131072`` in the environment: glibc then maps every large
buffer and unmaps it when freed, so the RSS follows the live tensors (with its default, the
heap keeps freed buffers resident, which hides most of what checkpointing saves: see
docs/performance.md). For each arm it prints the peaks and the largest width whose
interpolated peak stays under ``--cap-mb`` (linear between the measured widths; "beyond"
when the widest fits); an arm stops at the first width over the cap.
"""

import argparse
import json
import os
import resource
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn import functional as F

ARMS = {"ddp": ("ddp", False), "ddp+ac": ("ddp", True), "fsdp": ("fsdp", False),
        "fsdp+ac": ("fsdp", True)}
MB = 2**20


def rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def worker(rank: int, nproc: int, port: int, options: dict, out: str) -> None:
    from recipes.charlm.model import GPT

    base = rss_mb()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=nproc)
    torch.manual_seed(0)
    strategy, checkpointing = ARMS[options["arm"]]
    model = GPT(256, options["block_size"], options["n_layer"], options["n_embd"] // 64,
                options["n_embd"], activation_checkpointing=checkpointing)
    if strategy == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for block in model.transformer.h:
            fully_shard(block)
        fully_shard(model)
        train_model = model
    else:
        train_model = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(rank)
    losses = []
    for step in range(options["steps"]):
        # The first step, on one window, only creates AdamW's state cheaply: the peak comes
        # in a later step, whose forward and backward run beside that state.
        windows = 1 if step == 0 else options["batch"]
        batch = torch.randint(0, 256, (windows, options["block_size"] + 1),
                              generator=generator)
        logits = train_model(batch[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    Path(out, f"{rank}.json").write_text(json.dumps({"base": base, "peak": rss_mb(),
                                                     "losses": losses}))
    dist.destroy_process_group()


def measure(arm: str, width: int, options: argparse.Namespace, port: int) -> list[dict]:
    with tempfile.TemporaryDirectory() as out:
        settings = {"arm": arm, "n_embd": width, "n_layer": options.n_layer,
                    "block_size": options.block_size, "batch": options.batch,
                    "steps": options.steps}
        mp.spawn(worker, (options.nproc, port, settings, out), nprocs=options.nproc)
        return [json.loads(Path(out, f"{rank}.json").read_text())
                for rank in range(options.nproc)]


def largest_width(points: list[tuple[int, float]], cap: float) -> str:
    """The width where the peak crosses ``cap``, linear between measured widths."""
    if points[0][1] > cap:
        return f"< {points[0][0]}"
    for (w0, p0), (w1, p1) in zip(points, points[1:], strict=False):
        if p1 > cap:
            return f"{w0 + (cap - p0) / (p1 - p0) * (w1 - w0):.0f}"
    return f"beyond {points[-1][0]}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.tools.charlm_memory",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--widths", default="256,512,768")
    parser.add_argument("--arms", default=",".join(ARMS))
    parser.add_argument("--cap-mb", type=float, default=1536.0,
                        help="the memory cap per process, MB above the process's baseline")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--block-size", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8, help="windows per process and step")
    parser.add_argument("--steps", type=int, default=2)
    options = parser.parse_args(argv)
    widths = [int(width) for width in options.widths.split(",")]
    print(f"n_layer {options.n_layer}, block {options.block_size}, {options.batch} windows "
          f"per process, {options.nproc} processes, {options.steps} AdamW steps; "
          f"MALLOC_MMAP_THRESHOLD_={os.environ.get('MALLOC_MMAP_THRESHOLD_', 'unset')}")
    print("| arm | " + " | ".join(f"n_embd {width}" for width in widths)
          + f" | widest under {options.cap_mb:.0f} MB |")
    print("|---|" + "---|" * (len(widths) + 1))
    port = 29400 + os.getpid() % 1000
    for arm in options.arms.split(","):
        points, cells = [], []
        for width in widths:
            port += 1
            ranks = measure(arm, width, options, port)
            above = [rank["peak"] - rank["base"] for rank in ranks]
            points.append((width, max(above)))
            losses = ranks[0]["losses"]
            cells.append("/".join(f"{value:.0f}" for value in above)
                         + f" (loss {losses[0]:.4f}, last {losses[-1]:.6f})")
            print(f"{arm} {width}: {cells[-1]}", file=sys.stderr, flush=True)
            if max(above) > options.cap_mb:
                break
        cells += ["—"] * (len(widths) - len(cells))
        print(f"| {arm} | " + " | ".join(cells)
              + f" | {largest_width(points, options.cap_mb)} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
