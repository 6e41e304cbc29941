"""Two machines, played on this one: two torchrun agents (``--nnodes 2 --nproc-per-node 1``,
the c10d rendezvous on 127.0.0.1, gloo on the CPU, ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``:
docs/distributed.md, "Restarts"), each started in a working folder of its own and pinned to a
core of its own, as a machine has its own cores (each worker then trains on one thread, as each
process of ``--nproc 2`` does here). The run is named with ``--run-name``: rank 0 resolves it
in node 0's working folder, which plays the filesystem the machines share, and tells every
process its absolute path; node 1's working folder must stay empty.

What is checked: two nodes train what ``--nproc 2`` trains on one (within the reduction-order
bound); a worker killed with ``kill -9`` on either node, its group restarted by torchrun, ends
bit-identical to an uninterrupted two-node run; a lost node (its agent and worker killed) ends
the survivor in one line naming it, at once, and a node that stops answering does so after
``--collective-timeout``, both with the run's checkpoints intact; a lost node started again
rejoins its group, which ends bit-identical to an uninterrupted run.

charlm DDP is what CI runs here (``make test-reliability``: about 2.5 minutes on two workers
of this 2-core machine). The cifar and FSDP variants (cifar's full-size net costs about 50 s a
case) and the kill of rank 0's worker are marked ``slow`` and ``other_recipes``, which CI
leaves out: ``make test-slow`` runs them. Under FSDP every process writes its shards into the
run folder and reads them back on a resume: node 1's working folder stays empty there too.
"""

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from handlers.checkpoint.files import checkpoint_in
from handlers.checkpoint.formats import read_checkpoint
from tests.helpers import (
    CHARLM,
    CIFAR_RUN,
    REPO,
    RUN_RECIPE,
    assert_bit_identical,
    assert_state_within_reduction_order,
    write_text,
)

pytestmark = pytest.mark.reliability

TIMEOUT_SEC = 300  # a two-node run takes 15-60 s here; generous for a loaded machine
LOST_PEER_BOUND_SEC = 120  # the survivor of a lost node must have ended by then
SMALL_COLLECTIVE_TIMEOUT = 10  # seconds, for the node that stops answering
OFF_CI = [pytest.mark.slow, pytest.mark.other_recipes]
# The uninterrupted runs start the plain command line: run_recipe.py's narrow CIFAR net would
# not reach the processes that --nproc spawns. The faulted runs start run_recipe.py, which for
# charlm changes nothing but the fault.
PLAIN = ("-m", "recipes")


@dataclass(frozen=True)
class Job:
    """A recipe's tiny run, and the iteration at which a worker stops in the fault tests
    (after the checkpoint of ``committed_step``, the newest one committed by then)."""

    name: str
    args: tuple[str, ...]
    fault_iteration: int
    committed_step: int


def charlm_job(folder: Path, strategy: str = "ddp") -> Job:
    """2 epochs of 19 iterations, a checkpoint every 4 steps: a stop at iteration 14 comes
    after the step-12 checkpoint."""
    text = write_text(folder / "text.txt")
    return Job("charlm", (*CHARLM, "--text", str(text), "--epochs", "2",
                          "--checkpoint-every", "4", "--strategy", strategy), 14, 12)


def cifar_job(strategy: str) -> Job:
    """The narrow airbench on 128 synthetic images: 2 epochs of 4 iterations, a checkpoint
    every 2 steps; without Lookahead, which FSDP refuses."""
    return Job("cifar", (*CIFAR_RUN, "--device", "cpu", "--checkpoint-every", "2",
                         "--lookahead", "false", "--strategy", strategy), 6, 4)


def _env(**extra: str) -> dict[str, str]:
    clean = {key: value for key, value in os.environ.items()
             if not key.startswith(("RELIABILITY_", "CKPT_TEST_", "TORCHELASTIC_"))}
    return clean | {"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1",
                    "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", **extra}


def _core(index: int) -> set[int]:
    cores = sorted(os.sched_getaffinity(0))
    return {cores[index % len(cores)]}


class Node:
    """One torchrun agent, as on a machine of its own: its working folder, its output files,
    the worker it starts."""

    def __init__(self, index: int, root: Path, command: list[str], faults: dict[str, str]):
        self.index, self.command = index, command
        self.cwd = root / f"node{index}"
        self.cwd.mkdir(exist_ok=True)
        self.start(faults)

    def start(self, faults: dict[str, str]) -> None:
        """Start the agent (again: the same command, in the same folder)."""
        self.stdout = self.cwd.parent / f"node{self.index}.stdout.txt"
        self.stderr = self.cwd.parent / f"node{self.index}.stderr.txt"
        with open(self.stdout, "a") as out, open(self.stderr, "a") as err:
            self.agent = subprocess.Popen(
                self.command, cwd=self.cwd, stdout=out, stderr=err, env=_env(**faults),
                preexec_fn=lambda: os.sched_setaffinity(0, _core(self.index)))

    def workers(self) -> list[int]:
        """The process ids of the workers the agent runs now."""
        try:
            return [int(pid) for task in Path(f"/proc/{self.agent.pid}/task").iterdir()
                    for pid in (task / "children").read_text().split()]
        except FileNotFoundError:  # the agent has ended
            return []

    def worker(self) -> int:
        """The process id of the agent's worker, once it has started."""
        deadline = time.monotonic() + TIMEOUT_SEC
        while not self.workers():
            assert time.monotonic() < deadline, f"node {self.index}'s agent started no worker"
            time.sleep(0.1)
        return self.workers()[0]

    def kill(self) -> None:
        """kill -9 of the agent and its worker (the agent starts the worker in a session of
        its own: killing the agent alone leaves it running)."""
        workers = self.workers()
        self.agent.kill()
        for pid in workers:
            os.kill(pid, signal.SIGKILL)
        self.agent.wait()

    def wait(self) -> int:
        return self.agent.wait(timeout=TIMEOUT_SEC)

    def output(self) -> tuple[str, str]:
        return self.stdout.read_text(), self.stderr.read_text()


class TwoNodes:
    """Node 0 hosts the rendezvous store (it is started first, node 1 once the store is up);
    each node runs ``job`` as the same torchrun command."""

    def __init__(self, root: Path, job: Job, run_name: str, *extra: str, max_restarts: int = 0,
                 faults: tuple[dict[str, str], dict[str, str]] = ({}, {}),
                 entry: tuple[str, ...] = (str(RUN_RECIPE),)):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        command = [str(Path(sys.executable).with_name("torchrun")), "--nnodes=2",
                   "--nproc-per-node=1", f"--max-restarts={max_restarts}",
                   "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
                   "--rdzv-id=two-nodes", *entry, *job.args, "--run-name", run_name, *extra]
        self.run_dir = root.resolve() / "node0" / "runs" / job.name / run_name
        self.nodes = [Node(0, root, command, faults[0])]
        _wait_for_port(port)
        self.nodes.append(Node(1, root, command, faults[1]))

    def wait(self) -> list[int]:
        return [node.wait() for node in self.nodes]

    def stop(self) -> None:
        """End whatever still runs (a failed test's processes, a stopped worker)."""
        for node in self.nodes:
            if node.agent.poll() is None:
                node.kill()


def _wait_for_port(port: int) -> None:
    deadline = time.monotonic() + TIMEOUT_SEC
    while time.monotonic() < deadline:
        with socket.socket() as probe:
            if probe.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise AssertionError("node 0's agent did not start the rendezvous store")


@pytest.fixture
def two_nodes(tmp_path):
    """Start two nodes with ``two_nodes(job, run_name, *extra, ...)``; the test's processes
    end with it."""
    started: list[TwoNodes] = []

    def start(job: Job, run_name: str, *extra: str, **options) -> TwoNodes:
        started.append(TwoNodes(tmp_path, job, run_name, *extra, **options))
        return started[-1]

    yield start
    for nodes in started:
        nodes.stop()


def _trained(nodes: TwoNodes) -> dict:
    """Both nodes' exit codes are 0; the final checkpoint, read whole."""
    codes = nodes.wait()
    assert codes == [0, 0], [node.output()[1][-3000:] for node in nodes.nodes]
    return _last(nodes.run_dir)


def _last(run_dir: Path) -> dict:
    return read_checkpoint(checkpoint_in(run_dir / "checkpoints", "last"))


def _on_one_node(job: Job, run_dir: Path) -> dict:
    """The same job under ``--nproc 2`` on one node, on the two cores the nodes use."""
    done = subprocess.run([sys.executable, *PLAIN, *job.args, "--nproc", "2",
                           "--run-dir", str(run_dir)], env=_env(), capture_output=True,
                          text=True, timeout=TIMEOUT_SEC,
                          preexec_fn=lambda: os.sched_setaffinity(0, _core(0) | _core(1)))
    assert done.returncode == 0, done.stderr[-3000:]
    return _last(run_dir)


def _assert_same_training(actual: dict, expected: dict) -> None:
    """Model and optimizer state bit-identical, at the same iteration."""
    assert actual["meta"]["iteration"] == expected["meta"]["iteration"]
    for part in ("model", "optimizer"):
        assert_bit_identical(actual[part], expected[part], part)


def _files(folder: Path) -> set[str]:
    """The run folder's files, but TensorBoard's event files, named by host, pid and time."""
    return {str(path.relative_to(folder)) for path in folder.rglob("*")
            if "tfevents" not in path.name}


CASES = [pytest.param("charlm", "ddp", id="charlm-ddp"),
         pytest.param("charlm", "fsdp", id="charlm-fsdp", marks=OFF_CI),
         pytest.param("cifar", "ddp", id="cifar-ddp", marks=OFF_CI),
         pytest.param("cifar", "fsdp", id="cifar-fsdp", marks=OFF_CI)]


def _job(recipe: str, strategy: str, folder: Path) -> Job:
    return charlm_job(folder, strategy) if recipe == "charlm" else cifar_job(strategy)


@dataclass(frozen=True)
class Trained:
    """A job trained on two nodes, never interrupted: its nodes (ended) and final checkpoint."""

    job: Job
    nodes: TwoNodes
    final: dict


@pytest.fixture(scope="module")
def trained_on_two_nodes(tmp_path_factory) -> Callable[[str, str], Trained]:
    """``trained_on_two_nodes(recipe, strategy)``: the job trained on two nodes, once a
    module: what the same job on one node trains, and what a faulted run must end as."""
    done: dict[tuple[str, str], Trained] = {}

    def trained(recipe: str, strategy: str) -> Trained:
        if (recipe, strategy) not in done:
            root = tmp_path_factory.mktemp(f"{recipe}-{strategy}")
            job = _job(recipe, strategy, root)
            nodes = TwoNodes(root, job, "uninterrupted", entry=PLAIN)
            try:
                done[recipe, strategy] = Trained(job, nodes, _trained(nodes))
            finally:
                nodes.stop()
        return done[recipe, strategy]

    return trained


@pytest.mark.parametrize("recipe, strategy", CASES)
def test_two_nodes_train_what_two_processes_on_one_node_train(recipe, strategy,
                                                              trained_on_two_nodes, tmp_path):
    trained = trained_on_two_nodes(recipe, strategy)
    job, nodes, two = trained.job, trained.nodes, trained.final
    one = _on_one_node(job, tmp_path / "one-node")

    steps = one["meta"]["optimizer_step"]
    assert two["meta"]["optimizer_step"] == steps > 1
    assert_state_within_reduction_order(two, one, steps)
    # Rank 0 wrote the run folder (under FSDP each rank its shards, into the folders rank 0
    # committed): the same files as on one node, and none in node 1's working folder.
    assert _files(nodes.run_dir) == _files(tmp_path / "one-node")
    assert list(nodes.nodes[1].cwd.iterdir()) == []
    assert [path.name for path in nodes.nodes[0].cwd.iterdir()] == ["runs"]


@pytest.mark.parametrize("rank, strategy", [pytest.param(0, "ddp", marks=OFF_CI), (1, "ddp"),
                                            pytest.param(1, "fsdp", marks=OFF_CI)])
def test_a_worker_killed_on_either_node_restarts_the_group_which_ends_bit_identical(
        rank, strategy, trained_on_two_nodes, two_nodes):
    """Under FSDP each process reads its own shards of the checkpoint back."""
    reference = trained_on_two_nodes("charlm", strategy)
    job, expected = reference.job, reference.final
    faults = {"RELIABILITY_SIGNAL_AT": f"SIGKILL:iteration:{job.fault_iteration}",
              "RELIABILITY_SIGNAL_RANK": str(rank)}
    nodes = two_nodes(job, "killed", max_restarts=1, faults=(faults, faults))
    actual = _trained(nodes)
    stdout = nodes.nodes[0].output()[0]
    last = "last.dcp" if strategy == "fsdp" else "last.pt"
    assert f"resumed from {nodes.run_dir}/checkpoints/{last} (epoch 1, iteration " \
           f"{job.committed_step}, step {job.committed_step})" in stdout, stdout
    _assert_same_training(actual, expected)
    assert list(nodes.nodes[1].cwd.iterdir()) == []


def _stopped_at_fault(job: Job) -> dict[str, str]:
    """Node 1's worker stops itself (SIGSTOP) where the fault tests lose it: a fixed point."""
    return {"RELIABILITY_SIGNAL_AT": f"SIGSTOP:iteration:{job.fault_iteration}"}


def _wait_until_stopped(pid: int) -> None:
    deadline = time.monotonic() + TIMEOUT_SEC
    while Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "T":
        assert time.monotonic() < deadline, "node 1's worker did not stop"
        time.sleep(0.1)


def _lost_peer_line(node: Node, since: float) -> tuple[str, float]:
    """The survivor's line about its lost peer, and the seconds from ``since`` until its
    agent ended (after its worker had said it)."""
    node.agent.wait(timeout=LOST_PEER_BOUND_SEC)
    seconds = time.monotonic() - since
    stderr = node.output()[1]
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, stderr[-3000:]
    assert "[rank0]:" not in stderr, stderr[-3000:]  # a worker's traceback
    assert "failed (exitcode: 5)" in stderr, stderr[-3000:]  # torchrun's own report
    return errors[0], seconds


def test_a_lost_node_ends_the_survivor_in_one_line_keeping_the_checkpoints(two_nodes,
                                                                          tmp_path):
    """No restarts: node 1's agent and worker killed with kill -9 (at a fixed point: the
    worker first stops itself there). Node 0's worker says whom it lost, at once."""
    job = charlm_job(tmp_path)
    nodes = two_nodes(job, "lost", faults=({}, _stopped_at_fault(job)))
    lost = nodes.nodes[1].worker()
    _wait_until_stopped(lost)
    killed = time.monotonic()
    nodes.nodes[1].kill()

    line, seconds = _lost_peer_line(nodes.nodes[0], killed)
    print(f"the survivor ended {seconds:.1f} s after the kill")
    assert line.startswith(f"error: rank 0 lost rank 1 (pid {lost} on {socket.gethostname()}): "
                           "the connection to it failed ("), line
    assert line.endswith("; the checkpoints written are kept; to continue the run, run the "
                         "same torchrun command again on every machine"), line
    assert nodes.nodes[0].agent.returncode != 0
    assert _last(nodes.run_dir)["meta"]["iteration"] == job.committed_step


def test_a_node_that_stops_answering_times_out_in_one_line(two_nodes, tmp_path):
    """No restarts, ``--collective-timeout 10``: node 1's worker stops (SIGSTOP) and never
    answers again; node 0's worker says so once the collective has waited 10 s."""
    job = charlm_job(tmp_path)
    nodes = two_nodes(job, "stopped", "--collective-timeout", str(SMALL_COLLECTIVE_TIMEOUT),
                      faults=({}, _stopped_at_fault(job)))
    stopped = nodes.nodes[1].worker()
    _wait_until_stopped(stopped)

    line, seconds = _lost_peer_line(nodes.nodes[0], time.monotonic())
    print(f"the survivor ended {seconds:.1f} s after its peer stopped")
    assert line.startswith(f"error: rank 0 lost rank 1 (pid {stopped} on "
                           f"{socket.gethostname()}): no answer within --collective-timeout "
                           f"{SMALL_COLLECTIVE_TIMEOUT} s (Timed out waiting "), line
    assert seconds >= SMALL_COLLECTIVE_TIMEOUT - 1
    assert _last(nodes.run_dir)["meta"]["iteration"] == job.committed_step


def test_a_lost_node_started_again_rejoins_and_the_run_ends_bit_identical(trained_on_two_nodes,
                                                                         two_nodes):
    """``--max-restarts 1`` on both agents: node 1's agent and worker killed with kill -9,
    then node 1 started again with the same command. Node 0's worker loses its peer and
    exits; its agent restarts it, the two agents form the group again and the run resumes."""
    reference = trained_on_two_nodes("charlm", "ddp")
    job, expected = reference.job, reference.final
    nodes = two_nodes(job, "rejoined", max_restarts=1, faults=({}, _stopped_at_fault(job)))
    _wait_until_stopped(nodes.nodes[1].worker())
    nodes.nodes[1].kill()
    nodes.nodes[1].start({})

    actual = _trained(nodes)
    stdout, stderr = nodes.nodes[0].output()
    assert "the checkpoints written are kept; torchrun starts the group again (1 restart(s) " \
           "left); where a machine's torchrun is gone, run the same torchrun command there " \
           "again\n" in stderr, stderr[-3000:]
    assert f"(epoch 1, iteration {job.committed_step}, step {job.committed_step})" in stdout, \
        stdout
    _assert_same_training(actual, expected)
