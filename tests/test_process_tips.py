"""The process-level tips: intra-op threads x workers x processes, the host allocator and the
OpenMP runtime loaded in a fresh process per trial, and DDP's own knobs."""
from __future__ import annotations

import math
import os

import pytest
import torch
import torch.distributed as dist

from conftest import SMALL_MODELS, TINY, compose_cfg
from speedbench.config import ConfigError, build_plan
from speedbench.measure import launch
from speedbench.measure.data import build_dataset
from speedbench.measure.trial import dataset_length, measure_trial
from speedbench.search import driver
from speedbench.studies import arms
from speedbench.techniques import Context, allocator, by_name, ddp_tuning, loader, parallel
from speedbench.techniques import environment, openmp, threads

CPU = Context(torch.device("cpu"))


def plan_of(*overrides: str, experiment: str | None = None, model: str = "transformer"):
    return build_plan(compose_cfg(*TINY, *SMALL_MODELS, f"model={model}", *overrides,
                                  experiment=experiment), experiment)


def trial(plan, variant: str = "default") -> dict:
    spec = plan.models[0]
    dataset = build_dataset(spec.dataset, dataset_length(plan, spec), seed=0)
    return measure_trial(plan, spec, variant, plan.variants[variant], 0, dataset)


# --- threads ------------------------------------------------------------------------------------
@pytest.mark.parametrize("cores,processes,workers,share", [
    (2, 1, 0, 2), (2, 1, 1, 1), (2, 2, 0, 1), (2, 2, 1, 1), (16, 4, 2, 2), (1, 2, 0, 1)])
def test_fair_share_is_floor_of_cores_over_processes_less_the_workers(cores, processes, workers,
                                                                      share):
    assert threads.fair_share(cores, processes, workers) == share


def test_the_variants_cross_threads_workers_and_processes_on_two_cores(monkeypatch):
    monkeypatch.setattr(loader, "cpu_count", lambda: 2)
    v = threads.thread_variants()
    assert v["all_cores"] == {"threads": 2} and v["one_thread"] == {"threads": 1}
    assert v["oversubscribed"]["threads"] == 2 and v["oversubscribed"]["data.num_workers"] == 2
    assert v["balanced"]["threads"] == threads.FAIR and v["balanced"]["data.num_workers"] == 1
    assert v["ddp_oversubscribed"] == {"parallel": "ddp", "threads": 2}
    assert v["ddp_balanced"] == {"parallel": "ddp", "threads": threads.FAIR}


def test_a_trial_records_the_threads_each_process_ran_with():
    before = torch.get_num_threads()
    plan = plan_of("threads=0", "data.num_workers=1")
    record = trial(plan)
    assert record["status"] == "ok", record["status"]
    share = threads.fair_share(loader.cpu_count(), 1, 1)
    assert record["threads_per_process"] == share == record["torch_threads"]
    assert record["train_processes"] == 1 and record["cpu_cores"] == loader.cpu_count()
    assert record["busy_threads"] == share + 1
    assert record["oversubscribed"] == (share + 1 > loader.cpu_count())
    assert torch.get_num_threads() == before


def test_the_threads_experiment_names_its_oversubscribed_and_balanced_variants():
    plan = plan_of(experiment="threads", model="resnet")
    assert plan.baseline == "all_cores"
    assert {"balanced", "oversubscribed", "ddp_balanced", "ddp_oversubscribed"} <= \
        set(plan.variants)
    ctx = Context(torch.device("cpu"))
    assert by_name("parallel").processes(plan.variants["ddp_balanced"], ctx) == \
        min(2, loader.cpu_count())


# --- allocator ----------------------------------------------------------------------------------
def test_a_missing_library_is_na_with_the_install_command():
    tech = by_name("allocator")
    recipe = plan_of("allocator=jemalloc",
                     "allocator_path=/nonexistent/libjemalloc.so.2").variants["default"]
    reason = tech.not_applicable(recipe, CPU)
    assert reason.startswith("n/a: jemalloc not found (/nonexistent/libjemalloc.so.2)")
    assert reason.endswith("install it: apt install libjemalloc2")
    recipe = plan_of("allocator=tcmalloc",
                     "allocator_path=/nonexistent/libtcmalloc_minimal.so.4").variants["default"]
    assert tech.not_applicable(recipe, CPU).endswith("apt install libtcmalloc-minimal4")
    wrong = plan_of("allocator=tcmalloc", "allocator_path=/usr/lib/libjemalloc.so.2")
    assert "is not a tcmalloc library" in tech.not_applicable(wrong.variants["default"], CPU)


def test_every_variant_but_inherit_starts_a_fresh_process_with_its_preload(monkeypatch):
    monkeypatch.setenv("LD_PRELOAD", "/x/libjemalloc.so.2 /y/libother.so")
    tech = by_name("allocator")
    assert tech.environment(plan_of().variants["default"], CPU) == {}
    system = plan_of("allocator=system").variants["default"]
    assert tech.environment(system, CPU) == {"LD_PRELOAD": "/y/libother.so"}
    assert allocator.preload("/lib/libtcmalloc.so.4") == "/lib/libtcmalloc.so.4 /y/libother.so"


def test_this_process_maps_the_system_malloc_unless_preloaded():
    expected = "system" if "malloc" not in os.environ.get("LD_PRELOAD", "") else None
    if expected is None:
        pytest.skip("this test process runs with a preloaded allocator")
    assert allocator.loaded_allocator() == "system"


def fresh_trial(*overrides: str) -> dict:
    """One trial run the way the rounds run it: in a worker of the arm its start-up variables
    make (studies/arms.variant_arm)."""
    plan = plan_of(*overrides)
    arm = arms.variant_arm(plan, "default", CPU)
    assert arm is not None and arm.env, "an allocator or OpenMP variant runs in a fresh process"
    return arms.trial(plan, plan.models[0], arm, "default", 0)


@pytest.mark.slow
def test_a_fresh_process_trial_runs_with_the_system_malloc():
    record = fresh_trial("allocator=system")
    assert record["status"] == "ok", record["status"]
    assert record["allocator_loaded"] == "system" and record["world_size"] == 1
    assert record["steps"] == 2 and record["samples_per_s"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(allocator.LIBRARIES))
def test_an_installed_allocator_is_the_one_the_trial_process_maps(kind):
    library = allocator.find_library(kind)
    if library is None:
        pytest.skip(f"{kind} is not installed here")
    record = fresh_trial(f"allocator={kind}")
    assert record["status"] == "ok", record["status"]
    assert record["allocator_library"] == library
    assert kind in record["allocator_loaded"]


# --- the OpenMP runtime -------------------------------------------------------------------------
def test_intel_openmp_missing_is_na_with_the_install_command_and_mistakes_are_named():
    tech = by_name("openmp")
    recipe = plan_of("openmp=intel", "openmp_path=/nonexistent/libiomp5.so").variants["default"]
    reason = tech.not_applicable(recipe, CPU)
    assert reason.startswith("n/a: Intel OpenMP not found (/nonexistent/libiomp5.so)")
    assert "install it: pip install intel-openmp" in reason
    assert tech.not_applicable(plan_of("openmp=gnu").variants["default"], CPU) is None
    with pytest.raises(ConfigError, match="kmp_blocktime: 1 acts only on Intel's OpenMP"):
        plan_of("openmp=gnu", "kmp_blocktime=1")
    with pytest.raises(ConfigError, match="openmp_bind: true acts at a process's start"):
        plan_of("openmp_bind=true")


def test_each_runtime_starts_a_fresh_process_with_its_variables(monkeypatch, tmp_path):
    monkeypatch.setenv("LD_PRELOAD", "/x/libiomp5.so /y/libother.so")
    lib = tmp_path / "libiomp5.so"
    lib.write_bytes(b"")
    tech = by_name("openmp")
    assert tech.environment(plan_of().variants["default"], CPU) == {}
    bound = plan_of("openmp=gnu", "openmp_bind=true").variants["default"]
    assert tech.environment(bound, CPU) == {"LD_PRELOAD": "/y/libother.so",
                                            "OMP_PROC_BIND": "close", "OMP_PLACES": "cores"}
    tuned = plan_of("openmp=intel", "openmp_bind=true", "kmp_blocktime=1",
                    f"openmp_path={lib}").variants["default"]
    assert tech.environment(tuned, CPU) == {
        "LD_PRELOAD": f"{lib} /y/libother.so",
        "KMP_AFFINITY": "granularity=fine,compact,1,0", "KMP_BLOCKTIME": "1"}
    # with another malloc in the same recipe: every library added, and no rival that one of
    # them replaces (the inherited libiomp5 beside this one; a GNU variant's inherited libiomp5)
    both = plan_of("openmp=intel", f"openmp_path={lib}", "allocator=system").variants["default"]
    assert environment(both, CPU)["LD_PRELOAD"].split() == [str(lib), "/y/libother.so"]
    gnu = plan_of("openmp=gnu", "allocator=system").variants["default"]
    assert environment(gnu, CPU)["LD_PRELOAD"].split() == ["/y/libother.so"]


def test_this_process_runs_its_parallel_regions_on_gnu_openmp():
    if "libiomp" in os.environ.get("LD_PRELOAD", "") or not os.path.exists("/proc/self/maps"):
        pytest.skip("not Linux, or this test process runs with Intel's OpenMP preloaded")
    assert openmp.serving_library().startswith("libgomp")
    assert openmp.block_time_ms() is None


@pytest.mark.slow
@pytest.mark.parametrize("runtime", ["gnu", "intel"])
def test_the_trial_process_runs_on_the_runtime_its_variant_names(runtime):
    extra = ["openmp_bind=true"] + (["kmp_blocktime=1"] if runtime == "intel" else [])
    if runtime == "intel" and openmp.find_iomp() is None:
        pytest.skip("Intel OpenMP is not installed here (pip install intel-openmp)")
    record = fresh_trial(f"openmp={runtime}", *extra)
    assert record["status"] == "ok", record["status"]
    expected = "libiomp5.so" if runtime == "intel" else "libgomp"
    assert record["openmp_loaded"].startswith(expected), record["openmp_loaded"]
    assert (record["kmp_blocktime_read"] == 1) if runtime == "intel" else \
        math.isnan(record["kmp_blocktime_read"])


# --- ddp_tuning ---------------------------------------------------------------------------------
def test_ddp_knobs_are_na_without_ddp_and_reach_its_constructor():
    tech = by_name("ddp_tuning")
    recipe = plan_of("static_graph=true", "bucket_cap_mb=1").variants["default"]
    reason = tech.not_applicable(recipe, CPU)
    assert reason.startswith("n/a: bucket_cap_mb, static_graph are arguments of "
                             "DistributedDataParallel") and "parallel=none" in reason
    assert ddp_tuning.options(recipe) == {"bucket_cap_mb": 1, "static_graph": True}
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        model = parallel.wrap(torch.nn.Linear(4, 4), "ddp", torch.device("cpu"),
                              {"bucket_cap_mb": 1, "gradient_as_bucket_view": True,
                               "static_graph": True})
        assert model.bucket_bytes_cap == 1024 * 1024
        assert model.gradient_as_bucket_view and model.static_graph
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.distributed
def test_ddp_knobs_train_under_torchrun_on_two_cpu_ranks():
    plan = plan_of("parallel=ddp", "gradient_as_bucket_view=true", "static_graph=true",
                   "bucket_cap_mb=1")
    recipe, spec = plan.variants["default"], plan.models[0]
    record = launch.launch_trial(plan, spec, "default", recipe, 0, 2)
    assert record["status"] == "ok", record["status"]
    assert record["world_size"] == 2 and record["static_graph"] is True


# --- the recipe search --------------------------------------------------------------------------
def test_the_recipe_search_considers_threads_the_allocator_and_ddp_knobs():
    groups = {g.name: g for g in driver.parse_groups(compose_cfg(*TINY, experiment="recipe"))}
    assert {"threads", "allocator", "openmp", "ddp_tuning"} <= set(groups)
    assert groups["threads"].naive == {"threads": None}
    assert {o.name for o in groups["allocator"].options} == {"jemalloc", "tcmalloc"}
