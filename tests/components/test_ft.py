"""Fault tolerance across replica groups (components/ft/groups.py): each group a torchrun job of its own,
a torchft lighthouse started here on loopback, workers really SIGKILLed (tests/support/ft_worker.py).

The references: plain HSDP (parallelism.dp_replicate 2) for the losses of groups without faults;
for faults, the survivor itself (every step logged, no restart) and the weights of both groups at
the end, which healing must have made equal."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from weft.components.config import ConfigError, parse_args
from weft.components.ft.checks import check_fault_tolerance, config_identity

from tests.support import REPO
from tests.support.dist_utils import free_port, run_distributed
from tests.support.train_runs import run as run_train

os.environ.setdefault("RUST_LOG", "warn")  # the lighthouse started here: its line per quorum, off
pytest.importorskip("torchft")

TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
STEPS = 10


def train_args(dump: Path, steps: int = STEPS) -> list[str]:
    return ["--job.config_file", "debug_model", "--job.dump_folder", str(dump), "--training.steps", str(steps),
            "--training.seq_len", "32", "--training.local_batch_size", "2", "--metrics.log_freq", "1",
            "--no-metrics.enable_tensorboard", "--lr_scheduler.warmup_steps", "2"]


def ft_args(group: int, lighthouse: str, groups: int = 2) -> list[str]:
    return ["--fault_tolerance.enable", "--fault_tolerance.replica_id", str(group),
            "--fault_tolerance.replica_groups", str(groups), "--fault_tolerance.lighthouse", lighthouse,
            "--fault_tolerance.hostname", "127.0.0.1", "--fault_tolerance.connect_timeout_seconds", "10",
            "--fault_tolerance.timeout_seconds", "20", "--fault_tolerance.quorum_timeout_seconds", "60"]


def launch(args: list[str], *, nproc: int = 1, restarts: int = 0, env: dict | None = None,
           script: str = "tests/support/ft_worker.py") -> subprocess.Popen:
    """A replica group as a torchrun job; a group of one process that is never restarted runs without
    torchrun's agent (its worker takes the same path: a world of one makes no process group)."""
    environment = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    launcher = ([sys.executable] if nproc == 1 and not restarts else
                [*TORCHRUN, "--nproc_per_node", str(nproc), "--max-restarts", str(restarts),
                 "--rdzv_backend", "c10d", "--rdzv_endpoint", "127.0.0.1:0"])
    return subprocess.Popen([*launcher, script, *args], cwd=REPO, env=environment, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def finish(run: subprocess.Popen, timeout: float = 150) -> str:
    try:
        out, err = run.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        run.kill()
        _, err = run.communicate()
        pytest.fail(f"timed out:\n{err[-4000:]}")
    assert run.returncode == 0, err[-4000:]
    return out + err


def hsdp_reference(world: int, args: list[str]) -> None:
    """Plain HSDP, the groups' reference: train.py's train on `world` gloo ranks, each forked from
    this process (torch already imported) rather than started by torchrun; its losses land in
    metrics.jsonl as a torchrun job's do."""
    run_distributed(run_train, world, args, timeout=240)


def records(dump: Path) -> list[dict]:
    return [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture
def lighthouse():
    """A lighthouse on loopback; yields (address, server). Groups that stop heartbeating for 1 s
    are left out of the next quorum; a quorum is looked for every 10 ms (torchft's default 100 ms
    would be added to every step of these short runs)."""
    from torchft.coordination import LighthouseServer

    def start(min_replicas: int, join_timeout_ms: int = 30000):
        server = LighthouseServer(bind="127.0.0.1:0", min_replicas=min_replicas, join_timeout_ms=join_timeout_ms,
                                  quorum_tick_ms=10, heartbeat_timeout_ms=1000)
        servers.append(server)
        return "http://127.0.0.1:" + server.address().rsplit(":", 1)[1]

    servers: list = []
    yield start
    for server in servers:
        server.shutdown()


# --- the config: one line for each thing the design rules out -------------------------------------

@pytest.mark.parametrize("args, message", [
    (["--fault_tolerance.replica_id", "2"], "fault_tolerance.replica_id = 2: outside the 2 replica groups (0 .. 1)"),
    (["--fault_tolerance.min_replica_groups", "3"], "fault_tolerance.min_replica_groups = 3: more than the 2"),
    (["--parallelism.dp_replicate", "2"], "parallelism.dp_replicate = 2: under fault tolerance the replica groups"),
    (["--fault_tolerance.lighthouse", ""], "fault_tolerance.lighthouse: empty and TORCHFT_LIGHTHOUSE is not set"),
    (["--fault_tolerance.process_group", "nccl"], "fault_tolerance.process_group = 'nccl': needs GPUs"),
])
def test_config_refusals(monkeypatch, args, message):
    monkeypatch.delenv("TORCHFT_LIGHTHOUSE", raising=False)
    cfg = parse_args(["--fault_tolerance.enable", "--fault_tolerance.lighthouse", "http://127.0.0.1:1", *args])
    with pytest.raises(ConfigError) as e:
        check_fault_tolerance(cfg, cfg.parallelism.dp_replicate, "cpu")
    assert message in str(e.value) and "\n" not in str(e.value)


def test_lighthouse_from_environment(monkeypatch):
    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", "http://127.0.0.1:1")
    check_fault_tolerance(parse_args(["--fault_tolerance.enable"]), 1, "cpu")


def test_dormant_keys_need_enable():
    with pytest.raises(ConfigError, match="fault_tolerance.replica_id"):
        parse_args(["--fault_tolerance.replica_id", "1"])


def test_config_identity_names_what_groups_must_share():
    base = ["--fault_tolerance.enable", "--fault_tolerance.lighthouse", "http://x:1"]
    one = config_identity(parse_args(base))
    assert config_identity(parse_args([*base, "--fault_tolerance.replica_id", "1", "--job.dump_folder", "g1",
                                       "--fault_tolerance.hostname", "h"])) == one
    assert config_identity(parse_args([*base, "--optimizer.lr", "1e-3"])) != one
    assert 0 <= one < 2**20  # a float32 sum over many groups stays exact


def test_dry_run_knows_the_groups(tmp_path, capsys, monkeypatch):
    """The dry run plans one group's mesh and says where it stands among the groups; it needs no
    lighthouse (nothing is started)."""
    from weft import train

    monkeypatch.delenv("TORCHFT_LIGHTHOUSE", raising=False)
    argv = ["--job.config_file", "debug_model", "--job.dump_folder", str(tmp_path / "out"), "--job.dry_run",
            "--job.dry_run_world_size", "2", "--fault_tolerance.enable", "--fault_tolerance.replica_id", "1",
            "--fault_tolerance.replica_groups", "3", "--fault_tolerance.semi_sync_method", "diloco",
            "--fault_tolerance.sync_steps", "50"]
    assert train.main(argv) == 0
    out = capsys.readouterr().out
    assert ("fault tolerance: replica group 1 of 3, each a torchrun job of 2 ranks with this mesh (6 ranks in all); "
            "weights synced by DiLoCo every 50 steps") in out
    assert not (tmp_path / "out").exists()
    assert train.main([*argv, "--parallelism.dp_replicate", "2"]) == 2  # refused in the dry run too
    assert "parallelism.dp_replicate = 2: under fault tolerance" in capsys.readouterr().err


def healed_fsdp_rank_continues_as_its_peer() -> list[bool]:
    """Worker: a peer's FSDP model, AdamW (one step taken) and schedule, sent the way torchft sends
    them (`training_state`'s save as local shards, pickled) into a group built from another seed with
    no optimizer state yet; then both take the same step."""
    import pickle

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from weft.components.ft.groups import local_tree, training_state
    from weft.models.llama import LLAMA_FLAVORS, Transformer
    from weft.parallelisms.fsdp import FSDPOptions, apply_fsdp
    from weft.parallelisms.materialize import materialize

    class Loader:
        def __init__(self, position):
            self.position = position

        def state_dict(self):
            return {"position": self.position}

        def load_state_dict(self, state):
            self.position = state["position"]

    def build(seed: int):
        with torch.device("meta"):
            model = Transformer(LLAMA_FLAVORS["debugmodel"])
        apply_fsdp(model, init_device_mesh("cpu", (torch.distributed.get_world_size(),)),
                   FSDPOptions(param_dtype=torch.float32))
        materialize(model, "cpu", seed=seed)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        return model, optimizer, scheduler, Loader(seed)

    def train_once(model, optimizer, scheduler):
        torch.manual_seed(3)
        model(torch.randint(0, 2048, (2, 16))).float().square().mean().backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()

    peer, healed = build(0), build(1)
    train_once(*peer[:3])
    sent = pickle.loads(pickle.dumps(local_tree(training_state(*peer)[0]())))
    plain = not any(isinstance(t, DTensor) for t in torch.utils._pytree.tree_leaves(sent))
    training_state(*healed)[1](sent)
    full = lambda model: [p.full_tensor() for p in model.parameters()]  # noqa: E731
    same_now = all(torch.equal(a, b) for a, b in zip(full(peer[0]), full(healed[0])))
    same_schedule = healed[2].get_last_lr() == peer[2].get_last_lr() and healed[3].position == 0
    train_once(*peer[:3])
    train_once(*healed[:3])
    same_after = all(torch.equal(a, b) for a, b in zip(full(peer[0]), full(healed[0])))
    return [plain, same_now, same_schedule, same_after]


def test_healing_copies_fsdp_shards_optimizer_schedule_and_data_position():
    from tests.support.dist_utils import run_distributed

    for checks in run_distributed(healed_fsdp_rank_continues_as_its_peer, 2):
        assert checks == [True, True, True, True]


def test_groups_with_different_configs_stop_at_their_first_step():
    """The config's hash rides in the gradient all-reduce: averaged with a group of another config
    it comes back changed, and the group stops with one line (here torchft's all-reduce is a stub
    that averages with one peer holding `peer_identity` and zero gradients)."""
    from weft.components.ft.groups import FaultToleranceError, ReplicaGroups

    class Work:
        def __init__(self, tensor, peer_identity):
            self.tensor, self.peer_identity = tensor, peer_identity

        def wait(self):
            peer = torch.zeros_like(self.tensor)
            peer[-1] = self.peer_identity
            self.tensor.add_(peer).div_(2)

    class Manager:
        peer_identity = 0.0

        def allreduce(self, tensor):
            return Work(tensor, self.peer_identity)

        def errored(self):
            return None

        def current_step(self):
            return 0

    groups = object.__new__(ReplicaGroups)
    groups.manager, groups.identity = Manager(), float(config_identity(parse_args([])))
    param = torch.nn.Parameter(torch.ones(3))
    param.grad = torch.full((3,), 4.0)
    groups.manager.peer_identity = groups.identity
    groups.average_gradients([param])
    assert param.grad.tolist() == [2.0, 2.0, 2.0]  # averaged with the peer's zeros
    groups.manager.peer_identity = groups.identity + 1
    with pytest.raises(FaultToleranceError, match="the replica groups were started with different configs"):
        groups.average_gradients([param])


def test_per_step_groups_move_moe_routing_biases_as_hsdp():
    """Averaging gradients, the MoE layers' token counts ride in the same all-reduce: each group then
    moves its routing bias as HSDP does from the counts summed over the replicas (the reference:
    balance_experts on those sums). torchft's all-reduce is a stub averaging with one peer."""
    import copy

    from weft.components.ft.groups import ReplicaGroups
    from weft.components.training.moe_balance import balance_experts
    from weft.models.common.moe import MoE

    own = [torch.tensor([5.0, 1.0, 0.0, 2.0]), torch.tensor([0.0, 3.0, 3.0, 2.0])]
    peer = [torch.tensor([0.0, 1.0, 6.0, 1.0]), torch.tensor([2.0, 0.0, 3.0, 3.0])]

    class Work:
        def __init__(self, tensor):
            self.tensor = tensor

        def wait(self):
            self.tensor.add_(torch.cat([torch.zeros(3), *peer, torch.tensor([groups.identity])])).div_(2)

    class Manager:
        def allreduce(self, tensor):
            return Work(tensor)

        def errored(self):
            return None

        def current_step(self):
            return 0

    model = torch.nn.ModuleList([MoE(8, 16, 4, 2), MoE(8, 16, 4, 2)])
    for layer, counts in zip(model, own):
        layer.tokens_per_expert.copy_(counts)
    hsdp = copy.deepcopy(model)
    for layer, a, b in zip(hsdp, own, peer):
        layer.tokens_per_expert.copy_(a + b)
    groups = object.__new__(ReplicaGroups)
    groups.manager, groups._model, groups.identity = Manager(), model, float(config_identity(parse_args([])))
    param = torch.nn.Parameter(torch.ones(3))
    param.grad = torch.full((3,), 4.0)
    groups.average_gradients([param])
    assert param.grad.tolist() == [2.0, 2.0, 2.0]
    imbalance, reference = balance_experts(model, 0.01), balance_experts(hsdp, 0.01)
    assert imbalance == pytest.approx(reference)
    assert all(torch.equal(a.expert_bias, b.expert_bias) for a, b in zip(model, hsdp))
    assert not torch.equal(model[0].expert_bias, copy.deepcopy(model[0]).expert_bias.zero_())  # it moved


def test_diloco_sync_averages_moe_routing_biases_and_checks_the_config():
    """Under diloco the MoE routing biases (buffers, which DiLoCo's sync of the parameters leaves
    out) are averaged over the groups at each sync and kept only if the sync commits; the config's
    hash rides with them. torchft's all-reduce is a stub averaging with one peer's biases."""
    from weft.components.ft.checks import FaultToleranceError
    from weft.components.ft.diloco import DiLoCoGroups
    from weft.models.common.moe import MoE

    class Work:
        def __init__(self, tensor, peer):
            self.tensor, self.peer = tensor, peer

        def wait(self):
            self.tensor.add_(self.peer).div_(2)

    class Manager:
        def allreduce(self, tensor):
            return Work(tensor, torch.cat([*(b.reshape(-1) for b in peer_biases), torch.tensor([peer_identity])]))

        def errored(self):
            return None

        def num_participants(self):
            return 2

    model = torch.nn.ModuleList([MoE(8, 16, 4, 2), MoE(8, 16, 4, 2)])
    own = [torch.tensor([0.1, -0.2, 0.3, 0.0]), torch.tensor([-0.5, 0.25, 0.0, 0.125])]
    peer_biases = [torch.tensor([0.3, 0.2, -0.1, 0.5]), torch.tensor([0.5, 0.75, -1.0, 0.125])]
    groups = object.__new__(DiLoCoGroups)
    groups.manager, groups._model, groups.step, groups.groups = Manager(), model, 6, 2
    groups.identity = peer_identity = float(config_identity(parse_args([])))
    groups.cfg = parse_args(["--fault_tolerance.enable"]).fault_tolerance
    groups.uncommitted, groups.in_a_row = 0, 0

    def sync(commits: bool) -> bool:
        groups._should_commit = lambda: commits
        return groups._counted_commit()

    for layer, bias in zip(model, own):
        layer.expert_bias.copy_(bias)
    assert not sync(False)  # a dropped sync keeps this group's biases
    assert all(torch.equal(layer.expert_bias, bias) for layer, bias in zip(model, own))
    assert sync(True)
    for layer, a, b in zip(model, own, peer_biases):
        assert torch.equal(layer.expert_bias, (a + b) / 2)
    peer_identity = groups.identity + 1
    with pytest.raises(FaultToleranceError, match="the replica groups were started with different configs"):
        sync(True)


def test_steps_that_never_commit_stop_the_run():
    """Too few groups for min_replica_groups while the lighthouse still forms quorums: every step is
    refused, and after MAX_UNCOMMITTED_IN_A_ROW of them the run stops with one line instead of
    burning the data (a stub stands for torchft's should_commit)."""
    from weft.components.ft.groups import MAX_UNCOMMITTED_IN_A_ROW, FaultToleranceError, ReplicaGroups

    class Manager:
        def num_participants(self):
            return 1

        def errored(self):
            return None

    groups = object.__new__(ReplicaGroups)
    groups.manager, groups.step, groups.groups = Manager(), 5, 2
    groups.cfg = parse_args(["--fault_tolerance.enable", "--fault_tolerance.min_replica_groups", "2"]).fault_tolerance
    groups.uncommitted, groups.in_a_row = 0, 0
    answers = iter([False, True] + [False] * MAX_UNCOMMITTED_IN_A_ROW)
    groups._should_commit = lambda: next(answers)
    answered = [groups._counted_commit() for _ in range(MAX_UNCOMMITTED_IN_A_ROW + 1)]
    assert answered == [False, True] + [False] * (MAX_UNCOMMITTED_IN_A_ROW - 1)  # one commit restarts the count
    with pytest.raises(FaultToleranceError, match=f"{MAX_UNCOMMITTED_IN_A_ROW} steps in a row not committed "
                                                  r"\(last: 1 of 2 groups, fault_tolerance.min_replica_groups = 2\)"):
        groups._counted_commit()
    assert groups.uncommitted == MAX_UNCOMMITTED_IN_A_ROW + 1


# --- groups without faults equal HSDP ----------------------------------------------------------------

@pytest.mark.slow
def test_two_groups_equal_hsdp_and_resume_after_all_killed(tmp_path, lighthouse):
    """Two groups of one process average their gradients through torchft: the mean of their losses
    is plain HSDP's (dp_replicate 2, one process per replica) at every step. Two more groups,
    checkpointing every 4 steps, are both SIGKILLed after step 6 and started again: each resumes
    from its step-4 checkpoint and logs the losses of the uninterrupted groups, bit for bit."""
    together, killed = lighthouse(min_replicas=2), lighthouse(min_replicas=2)
    checkpoints = ["--checkpoint.enable", "--checkpoint.interval", "4"]
    runs = [launch([*train_args(tmp_path / f"g{g}"), *ft_args(g, together)]) for g in (0, 1)]
    runs += [launch([*train_args(tmp_path / f"k{g}"), *checkpoints, *ft_args(g, killed)],
                    env={"WEFT_TEST_KILL": "between:6"}) for g in (0, 1)]
    for run in runs[2:]:
        run.communicate(timeout=150)
        assert run.returncode != 0  # SIGKILLed, no restarts
    resumed = [launch([*train_args(tmp_path / f"k{g}"), *checkpoints, *ft_args(g, killed)]) for g in (0, 1)]
    # The reference (dp_replicate 2), while the groups run.
    hsdp_reference(2, [*train_args(tmp_path / "hsdp"), "--parallelism.dp_replicate", "2"])
    for run in runs[:2]:
        finish(run)
    for run in resumed:
        assert "checkpoint: resumed from step 4" in finish(run)

    reference = [r["train/loss"] for r in records(tmp_path / "hsdp")]
    g0, g1 = (records(tmp_path / f"g{g}") for g in (0, 1))
    assert [r["step"] for r in g0] == [r["step"] for r in g1] == list(range(1, STEPS + 1))
    mean = [(a["train/loss"] + b["train/loss"]) / 2 for a, b in zip(g0, g1)]
    assert mean == pytest.approx(reference, abs=1e-5)
    assert g0[0]["train/loss"] != g1[0]["train/loss"]  # each group read its own share of the batch
    assert all(r["ft/participating_groups"] == 2 and r["ft/uncommitted_steps"] == 0 for r in g0 + g1)
    for g, uninterrupted in enumerate((g0, g1)):
        after_resume = records(tmp_path / f"k{g}")
        assert [r["step"] for r in after_resume] == list(range(1, STEPS + 1))
        assert [r["train/loss"] for r in after_resume] == [r["train/loss"] for r in uninterrupted]


@pytest.mark.slow
def test_two_groups_of_two_fsdp_ranks_equal_hsdp(tmp_path, lighthouse):
    """Groups with a mesh inside (FSDP over 2 ranks each): the gradient shards of rank r are averaged
    with rank r of the other group, which is HSDP (dp_replicate 2 x dp_shard 2) across the groups."""
    address, steps = lighthouse(min_replicas=2), 5
    runs = [launch([*train_args(tmp_path / f"g{g}", steps), "--parallelism.dp_shard", "2", *ft_args(g, address)],
                   nproc=2, script="train.py") for g in (0, 1)]
    hsdp_reference(4, [*train_args(tmp_path / "hsdp", steps), "--parallelism.dp_replicate", "2",
                       "--parallelism.dp_shard", "2"])
    for run in runs:
        finish(run, timeout=240)
    reference = [r["train/loss"] for r in records(tmp_path / "hsdp")]
    g0, g1 = (records(tmp_path / f"g{g}") for g in (0, 1))
    assert [(a["train/loss"] + b["train/loss"]) / 2 for a, b in zip(g0, g1)] == pytest.approx(reference, abs=1e-5)
    assert len(reference) == len(g0) == len(g1) == steps


# --- a group killed: the other trains on, the killed one heals ---------------------------------------

STEPS_KILLED = 14


def final_weights(dump: Path, step: int = STEPS_KILLED) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = dump / "final.pt"
    dcp_to_torch_save(dump / "checkpoint" / f"step-{step}", out)
    return torch.load(out, weights_only=False)["model"]


@pytest.mark.slow
def test_killed_group_rejoins_and_heals(tmp_path, lighthouse):
    """Group 1's worker is SIGKILLed twice: after its step 3, and as it enters step 8's gradient
    all-reduce while group 0 is inside its own. Group 0 logs every step once, without restarting;
    the step group 1 died in is committed nowhere. torchrun restarts group 1 each time; it heals
    from group 0 and ends at the last step with group 0's weights, bit for bit."""
    address = lighthouse(min_replicas=1)
    ready = tmp_path / "group1-restarted"
    common = ["--checkpoint.enable", "--checkpoint.interval", "1000"]
    survivor = launch([*train_args(tmp_path / "g0", STEPS_KILLED), *common, *ft_args(0, address)],
                      env={"WEFT_TEST_WAIT": f"5:{ready}.1,10:{ready}.2"})
    killed = launch([*train_args(tmp_path / "g1", STEPS_KILLED), *common, *ft_args(1, address)], restarts=2,
                    env={"WEFT_TEST_KILL": "between:3,allreduce:8", "WEFT_TEST_READY": str(ready)})
    survivor_log, killed_log = finish(survivor), finish(killed)

    g0, g1 = records(tmp_path / "g0"), records(tmp_path / "g1")
    assert [r["step"] for r in g0] == list(range(1, STEPS_KILLED + 1)), survivor_log[-3000:]
    assert "restart" not in survivor_log.lower()  # the survivor's torchrun never restarted it
    # alone from the kill until group 1 healed (after step 5, after step 10), together otherwise
    assert [r["ft/participating_groups"] for r in g0] == [2, 2, 2, 1, 1, 2, 2, 1, 1, 1, 2, 2, 2, 2]
    assert [r["ft/uncommitted_steps"] for r in g0] == [0] * 7 + [1] * 7  # step 8, which group 1 died in, once
    assert killed_log.count("healed from a live group") == 2, killed_log[-3000:]
    assert g1[-1]["step"] == STEPS_KILLED and g1[-1]["ft/heal_seconds"] > 0
    a, b = final_weights(tmp_path / "g0"), final_weights(tmp_path / "g1")
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_lighthouse_that_does_not_answer():
    """No lighthouse at the address: one line naming it and the time waited, within bounds."""
    from weft.components.ft.groups import FaultToleranceError, ReplicaGroups

    cfg = parse_args([*ft_args(0, f"http://127.0.0.1:{free_port()}"), "--fault_tolerance.connect_timeout_seconds", "2",
                      "--fault_tolerance.quorum_timeout_seconds", "2"])
    started = time.monotonic()
    with pytest.raises(FaultToleranceError) as e:
        groups = ReplicaGroups(cfg, torch.device("cpu"), (dict, lambda state: None))
        next(groups.steps(0, 10))
    assert str(e.value).startswith("fault_tolerance.lighthouse = http://127.0.0.1:")
    assert "no answer within 2 s" in str(e.value) and "\n" not in str(e.value)
    assert time.monotonic() - started < 30


# --- DiLoCo against the paper's algorithm ------------------------------------------------------------

def diloco_reference(cfg_args: list[str], groups: int, sync_steps: int, steps: int, outer: dict) -> list[list[float]]:
    """DiLoCo as Douillard et al. (2023), Algorithm 1, written here over weft's step: each worker
    starts from the global weights, takes `sync_steps` inner AdamW steps on its own share of the
    data, then the outer gradient (the mean over workers of global minus local weights) takes one
    Nesterov SGD step on the global weights, which every worker continues from. Each worker keeps
    its inner optimizer state across syncs. Returns each worker's loss per step."""
    from weft.components.data import batches, build_loader
    from weft.recipe.build import build_trainer
    from weft.recipe.plan import RunPlan
    from weft.recipe.step import train_step

    plan = RunPlan.from_config(parse_args(cfg_args), 1)
    t = plan.cfg.training
    workers = []
    for g in range(groups):
        trainer = build_trainer(plan, None, torch.device("cpu"))
        loader = build_loader(plan.cfg.data.format, plan.data_files, plan.tokenizer, seq_len=t.seq_len,
                              local_batch_size=t.local_batch_size, dp_rank=g, dp_world_size=groups)
        workers.append((list(trainer.model.parameters()), trainer.step, batches(loader)))
    global_weights = [torch.nn.Parameter(p.detach().clone()) for p in workers[0][0]]
    outer_sgd = torch.optim.SGD(global_weights, lr=outer["lr"], momentum=outer["momentum"], nesterov=True)
    losses: list[list[float]] = [[] for _ in range(groups)]
    for step in range(1, steps + 1):
        for g, (_, setup, data) in enumerate(workers):
            losses[g].append(train_step(setup, [next(data)]).loss.item())
        if step % sync_steps == 0:
            with torch.no_grad():
                for i, w in enumerate(global_weights):
                    w.grad = sum(w - params[i] for params, _, _ in workers) / groups
                outer_sgd.step()
                for params, _, _ in workers:
                    for p, w in zip(params, global_weights):
                        p.copy_(w)
    return losses


@pytest.mark.slow
def test_diloco_equals_the_papers_algorithm_and_resumes_after_all_killed(tmp_path, lighthouse):
    """Two groups under fault_tolerance.semi_sync_method = diloco, sync every 3 steps: each group's
    losses are those of its worker in `diloco_reference`, across three syncs. Two more groups,
    checkpointing every 4 steps, are both SIGKILLed after step 5 (after the sync of step 3, before
    that of step 6) and started again: they resume from step 4 inside the sync window, with the
    global weights of step 3 and the outer momentum, and log the uninterrupted groups' losses."""
    address, killed = lighthouse(min_replicas=2), lighthouse(min_replicas=2)
    steps, sync = 9, 3
    diloco = ["--fault_tolerance.semi_sync_method", "diloco", "--fault_tolerance.sync_steps", str(sync),
              "--fault_tolerance.outer_lr", "0.7", "--fault_tolerance.outer_momentum", "0.9"]
    checkpoints = ["--checkpoint.enable", "--checkpoint.interval", "4"]
    runs = [launch([*train_args(tmp_path / f"g{g}", steps), *ft_args(g, address), *diloco], script="train.py")
            for g in (0, 1)]
    runs += [launch([*train_args(tmp_path / f"k{g}", steps), *checkpoints, *ft_args(g, killed), *diloco],
                    env={"WEFT_TEST_KILL": "between:5"}) for g in (0, 1)]
    for run in runs[2:]:
        run.communicate(timeout=150)
        assert run.returncode != 0  # SIGKILLed, no restarts
    resumed = [launch([*train_args(tmp_path / f"k{g}", steps), *checkpoints, *ft_args(g, killed), *diloco])
               for g in (0, 1)]
    reference = diloco_reference(train_args(tmp_path / "reference", steps), 2, sync, steps,
                                 {"lr": 0.7, "momentum": 0.9})
    for run in runs[:2]:
        finish(run)
    for run in resumed:
        assert "checkpoint: resumed from step 4" in finish(run)
    for g in (0, 1):
        logged = [r["train/loss"] for r in records(tmp_path / f"g{g}")]
        assert logged == pytest.approx(reference[g], abs=1e-5)
        after_resume = records(tmp_path / f"k{g}")
        assert [r["step"] for r in after_resume] == list(range(1, steps + 1))
        assert [r["train/loss"] for r in after_resume] == logged
    assert reference[0][sync] != reference[1][sync]  # each group its own data after a sync too


@pytest.mark.slow
def test_diloco_group_killed_between_syncs_heals_at_the_next(tmp_path, lighthouse):
    """Under diloco (sync every 3 steps), group 1's worker is SIGKILLed after step 4. Group 0 trains
    on alone (its sync at step 6 commits with one group) and logs every step once; the restarted
    group 1 waits for group 0's next sync (step 9), heals from it before training and takes part
    in it, goes on from step 10, and both end with the same weights."""
    address = lighthouse(min_replicas=1)
    ready = tmp_path / "group1-restarted"
    common = ["--checkpoint.enable", "--checkpoint.interval", "1000", "--fault_tolerance.semi_sync_method", "diloco",
              "--fault_tolerance.sync_steps", "3"]
    survivor = launch([*train_args(tmp_path / "g0", 12), *common, *ft_args(0, address)],
                      env={"WEFT_TEST_WAIT": f"8:{ready}.1"})
    killed = launch([*train_args(tmp_path / "g1", 12), *common, *ft_args(1, address)], restarts=1,
                    env={"WEFT_TEST_KILL": "between:4", "WEFT_TEST_READY": str(ready)})
    finish(survivor)
    killed_log = finish(killed)
    assert [r["step"] for r in records(tmp_path / "g0")] == list(range(1, 13))
    assert "healed from a live group to step 9" in killed_log, killed_log[-3000:]
    assert [r["step"] for r in records(tmp_path / "g1")] == [10, 11, 12]  # nothing trained alone
    a, b = (final_weights(tmp_path / g, 12) for g in ("g0", "g1"))
    assert all(torch.equal(a[k], b[k]) for k in a)
