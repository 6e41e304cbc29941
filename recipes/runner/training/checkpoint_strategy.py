"""How a run's checkpoints take part across processes, by its ``--strategy`` (the format
itself is picked by ``handlers.checkpoint.formats.format_for``): rank 0 writes each ``.pt``,
every process its own shards of each ``.dcp``. A checkpoint of the other kind is refused
before anything is written.
"""

from pathlib import Path

from handlers.checkpoint.files import CHECKPOINT_NAME, claimed_position, committed_checkpoints
from handlers.checkpoint.formats import SUFFIXES
from recipes.runner.config.command_line import ConfigError
from recipes.runner.training.launch import RankZeroSave


def save_wrapper(strategy: str) -> type:
    """How each save takes part across processes: ``EveryRankSave`` for sharded saves,
    ``RankZeroSave`` for single files."""
    return EveryRankSave if strategy == "fsdp" else RankZeroSave


class EveryRankSave(RankZeroSave):
    """Every process saves (a sharded save is a collective: each writes its own shards) and
    learns whether every process's save worked; all raise the same ``CheckpointError`` if
    not, so all stop together with exit code 4. Attach it on every rank at the same events."""

    failure = "another process could not save it"

    def saves_here(self) -> bool:
        return True


def refuse_other_format(strategy: str, run_dir: Path, resume: str) -> None:
    """``ConfigError`` (one line) when the checkpoint this start would resume from is of the
    other strategy's kind: ``--resume FILE``, or a run folder whose committed checkpoints
    are all of the other kind."""
    wanted = SUFFIXES[strategy]
    if resume not in ("auto", "never"):
        found = [Path(resume)]
    else:
        found = [path for path in committed_checkpoints(run_dir / "checkpoints")
                 if CHECKPOINT_NAME.match(path.name)]
    if not found or any(path.suffix == wanted for path in found):
        return
    other = max(found, key=claimed_position)  # the newest
    theirs = next((name for name, suffix in SUFFIXES.items() if suffix == other.suffix), None)
    if theirs is None:
        return  # not a checkpoint name at all: the resume's own check names the problem
    raise ConfigError(f"--strategy {strategy}: {other} is a checkpoint of a --strategy {theirs} "
                      f"run ({other.suffix}, this run reads {wanted}); resume with --strategy "
                      f"{theirs}, or start a new run from its weights with --init-from")
