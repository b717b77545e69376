"""DDP communication hooks (fp16 / bf16 compression, PowerSGD) and FSDP2's
reshard_after_forward: registered where the docs say, n/a without DDP / FSDP with the reason,
bad settings refused in one line, and trained under torchrun on two CPU ranks over gloo."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from conftest import SMALL_MODELS, TINY, compose_cfg
from speedbench.config import ConfigError, build_plan
from speedbench.distributed import DistEnv
from speedbench.measure import launch
from speedbench.models import transformer
from speedbench.techniques import Context, by_name, parallel
from speedbench.techniques.comm_hook import make_hook, most_gain, registered
from speedbench.techniques.fsdp_reshard import after_forward, group_problem, setting

CPU = Context(torch.device("cpu"))


def plan_of(*overrides: str, experiment: str | None = None):
    return build_plan(compose_cfg(*TINY, *SMALL_MODELS, "model=transformer", *overrides,
                                  experiment=experiment), experiment)


@pytest.fixture
def one_rank_group():
    """A gloo process group of one rank in this process (DDP and FSDP2 need one)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def torchrun_env(world: int) -> DistEnv:
    return DistEnv(rank=0, world_size=world, local_rank=0, local_world_size=world, run_id="t")


# --- DDP communication hooks ------------------------------------------------------------------
def test_a_hook_without_ddp_is_na_and_the_rank_belongs_to_powersgd():
    tech = by_name("comm_hook")
    recipe = plan_of("ddp_comm_hook=bf16").variants["default"]
    reason = tech.not_applicable(recipe, CPU)
    assert reason.startswith("n/a: ddp_comm_hook=bf16 hooks DistributedDataParallel") and \
        "parallel=ddp" in reason
    assert tech.not_applicable(recipe, Context(CPU.device, dist_env=torchrun_env(2))) is None
    ranked = plan_of("ddp_comm_hook=fp16", "powersgd_rank=4").variants["default"]
    assert "powersgd_rank=4 is PowerSGD's" in tech.not_applicable(
        ranked, Context(CPU.device, dist_env=torchrun_env(2)))
    assert tech.not_applicable(plan_of().variants["default"], CPU) is None
    sgd = plan_of("ddp_comm_hook=powersgd").variants["default"]
    assert tech.not_applicable(sgd, Context(CPU.device, dist_env=torchrun_env(2))).startswith(
        "n/a: PowerSGD over gloo (a CPU): its hook waits on its own all-reduces")


def test_a_bad_hook_name_is_one_line_naming_the_key():
    with pytest.raises(ConfigError, match=r"^ddp_comm_hook: 'int8' is not allowed; choose one "
                                          r"of none, fp16, bf16, powersgd$"):
        plan_of("ddp_comm_hook=int8")


@pytest.mark.parametrize("kind,qualname", [("fp16", "fp16_compress_hook"),
                                           ("bf16", "bf16_compress_hook"),
                                           ("powersgd", "powerSGD_hook")])
def test_each_hook_is_registered_on_the_ddp_module_and_trains(kind, qualname, one_rank_group):
    torch.manual_seed(0)
    model = parallel.wrap(nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4)), "ddp",
                          torch.device("cpu"))
    recipe = plan_of(f"ddp_comm_hook={kind}").variants["default"]
    model = by_name("comm_hook").prepare_model(model, recipe, CPU)
    assert registered(model) == [qualname]
    before = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):  # PowerSGD compresses from its second step on
        opt.zero_grad()
        model(torch.randn(8, 32)).square().mean().backward()
        opt.step()
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_no_hook_leaves_ddps_own_allreduce():
    assert make_hook("none", 1) is None
    assert registered(nn.Linear(2, 2)) == []
    state, _ = make_hook("powersgd", 3)
    assert state.matrix_approximation_rank == 3 and state.start_powerSGD_iter == 2


def test_the_forecast_is_shown_but_not_a_bound_and_says_loopback():
    class Profile:
        def share(self, category):
            return {"other": 0.2}.get(category, 0.0)

    base = plan_of("parallel=ddp").variants["default"]
    fp16 = plan_of("parallel=ddp", "ddp_comm_hook=fp16").variants["default"]
    got = by_name("comm_hook").bound(fp16, base, Profile(), {})
    assert got.speedup == pytest.approx(1 / (1 - 0.2 * (1 - 1 / most_gain("fp16"))))
    assert not got.sound and "loopback" in got.why
    assert most_gain("powersgd") == float("inf")


# --- FSDP2 reshard_after_forward --------------------------------------------------------------
@pytest.mark.parametrize("text,value", [("true", True), ("False", False), ("4", 4), (2, 2)])
def test_the_setting_reads_true_false_or_a_group_size(text, value):
    assert setting(text) is value if isinstance(value, bool) else setting(text) == value


@pytest.mark.parametrize("bad", ["1", "maybe", "-2", "0"])
def test_a_bad_reshard_setting_is_one_line_naming_the_key(bad):
    with pytest.raises(ConfigError, match=rf"^reshard_after_forward: '{bad}' is not allowed; "
                                          "choose true, false or an integer >= 2$"):
        plan_of(f"reshard_after_forward={bad}")


def test_a_group_must_be_a_proper_divisor_of_the_world():
    assert group_problem(2, 4) is None
    assert "none (a group needs 4 ranks or more" in group_problem(2, 2)
    assert "allowed here: 2, 4" in group_problem(3, 8)


def test_reshard_without_fsdp_is_na_and_a_group_too_large_for_the_world_is_na():
    tech = by_name("fsdp_reshard")
    keep = plan_of("reshard_after_forward=false").variants["default"]
    assert tech.not_applicable(keep, CPU).startswith(
        "n/a: reshard_after_forward is an argument of FSDP2's fully_shard")
    group = plan_of("parallel=fsdp", "reshard_after_forward=2").variants["default"]
    reason = tech.not_applicable(group, Context(CPU.device, dist_env=torchrun_env(2)))
    assert reason.startswith("n/a: reshard_after_forward=2 must divide the 2 ranks")
    assert tech.not_applicable(group, Context(CPU.device, dist_env=torchrun_env(4))) is None
    assert "must divide the 2 ranks" in tech.not_applicable(group, CPU)  # 2 launched on a CPU
    assert tech.not_applicable(plan_of().variants["default"], CPU) is None


@pytest.mark.parametrize("value,kept", [("true", 0), ("false", 2)])
def test_the_blocks_get_the_setting_and_the_root_fsdps_own(value, kept, one_rank_group):
    torch.manual_seed(0)
    model = transformer.build(64, 16, 16, 2, 2)
    recipe = plan_of("parallel=fsdp", f"reshard_after_forward={value}").variants["default"]
    ctx = Context(torch.device("cpu"))
    model = by_name("fsdp_reshard").prepare_model(model, recipe, ctx)
    model = parallel.wrap(model, "fsdp", ctx.device, None, ctx.extra.get(parallel.FSDP_OPTIONS))
    seen = after_forward(model)
    assert seen["keep"] == kept and seen["keep"] + seen["reshard"] == 2  # two blocks
    model(*_lm_batch()).backward()


def _lm_batch():
    x = torch.randint(0, 64, (2, 16))
    return x, torch.roll(x, -1, 1)


# --- under torchrun, two CPU ranks over gloo ---------------------------------------------------
@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("overrides,column,expected", [
    (("parallel=ddp", "ddp_comm_hook=fp16"), "comm_hooks_registered", "fp16_compress_hook"),
    (("parallel=ddp", "ddp_comm_hook=bf16"), "comm_hooks_registered", "bf16_compress_hook"),
    (("parallel=fsdp", "reshard_after_forward=false"), "fsdp_after_forward", "keep 1"),
])
def test_trains_under_torchrun_on_two_cpu_ranks(overrides, column, expected):
    plan = plan_of(*overrides)
    recipe, spec = plan.variants["default"], plan.models[0]
    record = launch.launch_trial(plan, spec, "default", recipe, 0, 2)
    assert record["status"] == "ok", record["status"]
    assert record["world_size"] == 2 and record[column] == expected


@pytest.mark.slow
@pytest.mark.distributed
def test_a_group_of_two_reshards_within_it_under_torchrun_on_four_cpu_ranks():
    """4 ranks (more than this machine's cores: speedbench's own plan refuses that, the test
    launches them itself) make 2 a proper divisor of the world."""
    plan = plan_of("parallel=fsdp", "reshard_after_forward=2", "threads=1")
    recipe, spec = plan.variants["default"], plan.models[0]
    record = launch.launch_trial(plan, spec, "default", recipe, 0, 4)
    assert record["status"] == "ok", record["status"]
    assert record["world_size"] == 4 and record["fsdp_after_forward"] == "group 1"


def test_the_experiments_plan_their_variants():
    hooks = plan_of(experiment="comm_hook")
    assert hooks.baseline == "ddp" and {"fp16", "bf16", "powersgd"} <= set(hooks.variants)
    reshard = plan_of(experiment="fsdp_reshard")
    assert reshard.baseline == "reshard" and \
        reshard.variants["keep"].reshard_after_forward == "false"
