"""The speed tips' mechanics (sync reads, tensor creation, workers, accumulation), the machine-
dependent worker sweep, the `tips` suite's composition, and the tip experiments through the CLI."""
from __future__ import annotations

import math
import os

import pandas as pd
import pytest
import torch
from torch.utils.data import Dataset, get_worker_info

from conftest import TINY, compose_cfg, only_run_dir, run_cli
from speedbench.config import suite, sweeps
from speedbench import techniques
from speedbench.config import ConfigError, build_plan, micro_batch
from speedbench.techniques import Context
from speedbench.techniques.sync import LossMeter
from speedbench.techniques.tensor_creation import set_tensor_creation
from speedbench.measure.data import build_dataset, build_loader
from speedbench.models.transformer import TransformerLM
from speedbench.models.vae import ConvVAE
from speedbench.measure.train import Trainer

TIPS = ["workers", "pinning", "tensor_creation", "sync", "empty_cache", "accumulation"]
# accumulation splits the batch into up to 8 micro-batches: the batch must divide by 8.
TINY8 = [o if o != "batch_size=4" else "batch_size=8" for o in TINY]
# One thread per process: on two cores shared with other jobs, two spinning OpenMP threads per
# process make tiny steps hundreds of times slower. These tests check behaviour, not speed.
ONE_THREAD = {"OMP_NUM_THREADS": "1"}


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)  # conftest's fixture restores the count afterwards


# --- sync points ----------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["item", "numpy"])
def test_item_and_numpy_read_the_host_every_forward_pass(mode):
    meter = LossMeter(mode, every=10, device=torch.device("cpu"))
    losses = [torch.tensor(float(i)) for i in range(7)]
    for i, loss in enumerate(losses, 1):
        meter.add(loss)
        assert meter.host_reads == i
    assert meter.mean() == pytest.approx(3.0)
    assert meter.host_reads == 7  # mean() has nothing left to read


@pytest.mark.parametrize("every,adds", [(3, 7), (3, 9), (10, 4), (1, 5)])
def test_deferred_reads_the_host_once_every_k_forward_passes(every, adds):
    meter = LossMeter("deferred", every=every, device=torch.device("cpu"))
    for i in range(adds):
        meter.add(torch.tensor(float(i), requires_grad=True) * 1)
    assert meter.host_reads == adds // every
    assert meter.pending.requires_grad is False  # detached: no graph kept alive
    assert meter.mean() == pytest.approx(sum(range(adds)) / adds)
    assert meter.host_reads == math.ceil(adds / every)


# --- tensor creation ------------------------------------------------------------------------------
class Recorder:
    """A tensor factory that notes the device it was asked for (None: the host's default)."""

    def __init__(self):
        self.devices = []

    def __call__(self, *size, device=None, **kwargs):
        self.devices.append(device)
        return torch.zeros(*size, device=device, **kwargs)


@pytest.mark.parametrize("where,born", [("host", None), ("device", torch.device("meta"))])
def test_per_step_tensors_are_born_where_the_knob_says(where, born):
    model = TransformerLM(vocab_size=16, seq_len=4, dim=8, layers=1, heads=2)
    assert set_tensor_creation(model, where) == 1
    factory = Recorder()
    # 'meta' stands in for an accelerator: a device that is not the host.
    t = model.new_tensor(factory, 2, 3, device=torch.device("meta"))
    assert factory.devices == [born]
    assert t.device.type == "meta"  # either way the tensor ends up where it is used
    assert model.host_creations == (1 if where == "host" else 0)


def test_the_models_make_their_per_step_tensors_through_the_knob():
    vae = ConvVAE(image_size=16, width=4, latent=4)
    lm = TransformerLM(vocab_size=16, seq_len=4, dim=8, layers=1, heads=2)
    made = {vae: [], lm: []}
    for m in made:
        real = m.new_tensor

        def counting(factory, *args, _m=m, _real=real, **kwargs):
            made[_m].append(factory.__name__)
            return _real(factory, *args, **kwargs)

        m.new_tensor = counting  # every per-step tensor the model makes passes here
    vae(torch.randn(2, 3, 16, 16))
    lm(torch.randint(0, 16, (2, 4)), torch.randint(0, 16, (2, 4)))
    assert made[vae] == ["randn"]  # the noise
    assert made[lm] == ["arange", "ones"]  # positions and the causal mask


def test_host_creation_is_na_where_host_and_device_are_one():
    recipe = compose_cfg(*TINY, "tensor_creation=host")
    makes = TransformerLM(vocab_size=16, seq_len=4, dim=8, layers=1, heads=2)
    plain = torch.nn.Linear(2, 2)  # makes no per-step tensors

    def why(device, model):
        return techniques.not_applicable(recipe, Context(device=torch.device(device), model=model))

    assert why("cpu", makes).startswith("n/a:")
    assert why("meta", plain).startswith("n/a:")
    assert why("meta", makes) is None


# --- DataLoader workers ---------------------------------------------------------------------------
class WhoLoads(Dataset):
    """Each sample says which process and worker made it."""

    def __len__(self):
        return 16

    def __getitem__(self, i):
        info = get_worker_info()
        return torch.tensor([os.getpid(), -1 if info is None else info.id]), torch.tensor(0)


@pytest.mark.parametrize("workers", [0, 2])
def test_worker_processes_really_load_the_data(workers):
    cfg = compose_cfg(*TINY, f"data.num_workers={workers}", "data.persistent_workers=true")
    plan = build_plan(cfg, None)
    options = techniques.loader_options(plan.variants["default"], Context(torch.device("cpu")))
    loader = build_loader(WhoLoads(), 2, options, seed=0)
    who = torch.cat([x for x, _ in loader])
    pids, ids = set(who[:, 0].tolist()), set(who[:, 1].tolist())
    if workers:
        assert os.getpid() not in pids and len(pids) == workers
        assert ids == {0, 1}
    else:
        assert pids == {os.getpid()} and ids == {-1}


@pytest.mark.parametrize("cpus,gpus,expected", [
    (2, 0, [0, 1, 2]),  # 4, 8 and all CPUs capped at 2; 4 x 0 GPUs = 0
    (16, 1, [0, 1, 2, 4, 8, 16]),
    (16, 8, [0, 1, 2, 4, 8, 16]),  # 4 x 8 GPUs = 32, capped at 16
    (64, 8, [0, 1, 2, 4, 8, 32, 64]),
])
def test_worker_sweep_follows_the_machine(monkeypatch, cpus, gpus, expected):
    monkeypatch.setattr(sweeps, "cpu_count", lambda: cpus)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    entries = [0, 1, 2, 4, 8, "4xGPU", "CPUs"]
    assert sweeps.worker_counts(entries) == expected
    variants = sweeps.worker_variants(entries)
    assert list(variants) == [f"w{n}" for n in expected]
    assert variants["w0"] == {"data.num_workers": 0, "data.persistent_workers": False}
    assert variants[f"w{expected[-1]}"]["data.persistent_workers"] is True
    assert sweeps.workers_variant("4xGPU") == f"w{min(4 * gpus, cpus)}"


def test_workers_experiment_resolves_on_this_machine():
    plan = build_plan(compose_cfg(*TINY, experiment="workers"), "workers")
    counts = sweeps.worker_counts([0, 1, 2, 4, 8, "4xGPU", "CPUs"])
    assert plan.baseline == "w0" and list(plan.variants) == [f"w{n}" for n in counts]
    for n in counts:
        data = plan.variants[f"w{n}"].data
        assert data.num_workers == n and data.persistent_workers == (n > 0)
    resnet = next(m for m in plan.models if m.name == "resnet")
    assert resnet.dataset["stored_size"] > 2 * resnet.dataset["image_size"]  # decode-heavy


# --- gradient accumulation ------------------------------------------------------------------------
def _trainer(variant: str, *extra: str) -> Trainer:
    cfg = compose_cfg(*TINY8, "model=transformer", *extra, experiment="accumulation")
    plan = build_plan(cfg, "accumulation")
    spec, recipe = plan.models[0], plan.variants[variant]
    data = build_dataset(spec.dataset, 64, seed=0)
    loader = build_loader(data, micro_batch(recipe, spec),
                          techniques.loader_options(recipe, Context(torch.device("cpu"))), seed=0)
    return Trainer(spec, recipe, torch.device("cpu"), loader)


@pytest.mark.parametrize("variant,k", [("k1", 1), ("k4", 4)])
def test_accumulation_steps_the_optimizer_once_per_k_micro_batches(variant, k):
    trainer = _trainer(variant)
    assert trainer.loader.batch_size == 8 // k  # the effective batch stays 8
    calls = []
    real_step = trainer.optimizer.step
    trainer.optimizer.step = lambda *a, **kw: (calls.append(1), real_step(*a, **kw))
    for _ in range(3):
        trainer.step()
    assert len(calls) == 3 and trainer.optimizer_steps == 3
    assert trainer.meter.count == 3 * k  # k forward passes per optimizer step
    trainer.close()


def _first_update_grads(variant: str) -> list[torch.Tensor]:
    trainer = _trainer(variant)
    grads = []
    real_step = trainer.optimizer.step

    def step(*a, **kw):
        grads.extend(p.grad.detach().clone() for p in trainer.model.parameters())
        return real_step(*a, **kw)

    trainer.optimizer.step = step
    trainer.step()
    trainer.close()
    return grads


def test_k_micro_batches_give_the_update_of_one_k_times_larger_batch():
    one = _first_update_grads("k1")
    for variant in ("k2", "k8"):
        split = _first_update_grads(variant)
        assert len(split) == len(one)
        for a, b in zip(one, split):
            torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-6)


def test_split_needs_a_batch_that_divides():
    cfg = compose_cfg(*TINY, "batch_size=6", experiment="accumulation")
    with pytest.raises(ConfigError, match="accumulate: 4 does not divide the batch"):
        build_plan(cfg, "accumulation")
    with pytest.raises(ConfigError, match="accumulate_mode: 'sum' is not allowed; choose one of "
                                          "add, split"):
        build_plan(compose_cfg(*TINY, "accumulate_mode=sum"), None)


# --- the tips suite -------------------------------------------------------------------------------
def test_tips_composes_every_other_experiment_with_the_command_line_winning():
    cfg = compose_cfg(*TINY8, experiment="tips")
    names = suite.members(cfg, "tips")
    files = suite.experiment_files()
    assert "tips" not in names and set(TIPS) <= set(names)
    assert set(names) == {n for n in files if n != "tips" and not suite.runs_alone(files[n])}
    assert "recipe" in files and "recipe" not in names
    plans = suite.member_plans(cfg, "tips", TINY8 + ["+experiment=tips"])
    assert [p.experiment for p in plans] == names
    for plan in plans:
        for recipe in plan.variants.values():
            # the command line (bench.steps=2) wins over the member's own settings
            assert recipe.bench.steps == 2 and recipe.batch_size == 8
    acc = next(p for p in plans if p.experiment == "accumulation")
    assert acc.variants["k8"].accumulate_mode == "split"  # the member's own delta is kept
    claims = suite.combined_claims(plans)
    assert {c["experiment"] for c in claims} >= set(TIPS)
    assert "${" not in str(claims)  # machine-dependent variant names are resolved


def test_suite_exclude_and_mistakes():
    cfg = compose_cfg(*TINY, "suite.exclude=[amp,workers]", experiment="tips")
    assert "workers" not in suite.members(cfg, "tips") and "amp" not in suite.members(cfg, "tips")
    with pytest.raises(ConfigError, match="suite.exclude: 'nope' is not an experiment"):
        suite.members(compose_cfg(*TINY, "suite.exclude=[nope]", experiment="tips"), "tips")
    with pytest.raises(ConfigError, match="suites do not nest"):
        suite.members(compose_cfg(*TINY, "suite.experiments=[tips]", experiment="tips"), "tips")
    with pytest.raises(ConfigError, match="suite tips, experiment accumulation: .*accumulate"):
        suite.member_plans(compose_cfg(*TINY, experiment="tips"), "tips", TINY)  # batch 4 vs k8
    assert suite.member_overrides(["+experiment=tips", "suite.exclude=[amp]", "bench.steps=2"]) \
        == ["bench.steps=2"]


# --- through the CLI ------------------------------------------------------------------------------
@pytest.mark.slow
def test_tips_runs_every_experiment_into_one_report(tmp_path):
    proc = run_cli("+experiment=tips", "model=transformer", *TINY8, f"out_dir={tmp_path}",
                   cwd=tmp_path, env=ONE_THREAD)
    assert proc.returncode == 0, proc.stderr[-2000:]
    run_dir = only_run_dir(tmp_path)
    trials = pd.read_csv(run_dir / "trials.csv")
    assert set(TIPS) <= set(trials["experiment"])
    bad = trials[~trials["status"].str.match(r"^(ok$|n/a: )")]
    assert bad.empty, bad[["experiment", "variant", "status"]]
    cpu_na = {"pinning": ["pinned", "non_blocking", "pinned_non_blocking"],
              "tensor_creation": ["host", "device"], "empty_cache": ["every_step", "never"]}
    for exp, variants in cpu_na.items():  # reported as n/a rows, not dropped
        rows = trials[trials["experiment"] == exp].set_index("variant")
        assert all(rows.loc[[v], "status"].str.startswith("n/a: ").all() for v in variants)

    # sync: item and numpy read every forward pass, deferred once per 10 (and at the end)
    sync = trials[(trials["experiment"] == "sync") & (trials["status"] == "ok")]
    for r in sync.itertuples():
        want = r.steps if r.variant in ("item", "numpy") else math.ceil(r.steps / 10)
        assert r.host_reads == want, r
    acc = trials[(trials["experiment"] == "accumulation") & (trials["status"] == "ok")]
    pairs = sorted(set(zip(acc["accumulate"], acc["batch_size"])))
    assert pairs == [(1, 8), (2, 4), (4, 2), (8, 1)]  # (k, micro-batch): 8 samples per step
    # The largest batch that fits: searched on CUDA only, an n/a row with its reason elsewhere.
    capacity = pd.read_csv(run_dir / "capacity.csv")
    assert list(capacity[["experiment", "model", "variant"]].itertuples(index=False, name=None)) \
        == [("accumulation", "transformer", "k1")]
    assert capacity["status"].iloc[0].startswith("n/a: the largest batch that fits is searched "
                                                 "on CUDA only")

    summary = pd.read_csv(run_dir / "summary.csv")
    assert set(TIPS) <= set(summary["experiment"])
    report = (run_dir / "report.md").read_text()
    assert "## The articles' claims, measured" in report and "## DataLoader workers" in report
    claims_md = report.split("## The articles' claims, measured")[1]
    for exp in TIPS:
        assert f"| {exp} | transformer |" in claims_md
    assert "| n/a: pin_memory needs CUDA" in claims_md
    assert "| nan |" not in report  # an n/a verdict read back from summary.csv stays "n/a"
    assert "### Largest batch that fits\n\nNot found on this run: the largest batch" in report
    assert (run_dir / "members" / "workers.yaml").exists()

    # The report rebuilds from the run's files alone, with the same claims.
    (run_dir / "report.md").unlink()
    again = run_cli(str(run_dir), cwd=tmp_path, module="speedbench.report", env=ONE_THREAD)
    assert again.returncode == 0, again.stderr[-2000:]
    assert (run_dir / "report.md").read_text() == report


@pytest.mark.slow
def test_workers_experiment_on_images_starts_worker_processes(tmp_path):
    proc = run_cli("+experiment=workers", "model=vae", *TINY, "bench.repeats=1",
                   "models.vae.small.dataset.stored_size=64", f"out_dir={tmp_path}", cwd=tmp_path,
                   env=ONE_THREAD)
    assert proc.returncode == 0, proc.stderr[-2000:]
    trials = pd.read_csv(only_run_dir(tmp_path) / "trials.csv")
    assert (trials["status"] == "ok").all()
    for r in trials.itertuples():
        assert r.num_workers == int(r.variant[1:])
        assert 0 <= r.data_wait_frac <= 1
        if r.num_workers:  # the pages only the workers hold come on top of the main process
            assert r.host_rss_mb > r.host_rss_main_mb
        else:
            assert r.host_rss_mb == r.host_rss_main_mb


# --- on a GPU: the knobs that are n/a on the CPU act ----------------------------------------------
@pytest.mark.gpu
def test_host_creation_on_cuda_creates_on_the_host_then_moves():
    vae = ConvVAE(image_size=16, width=4, latent=4).cuda()
    set_tensor_creation(vae, "host")
    vae(torch.randn(2, 3, 16, 16, device="cuda"))
    assert vae.host_creations == 1
    set_tensor_creation(vae, "device")
    vae(torch.randn(2, 3, 16, 16, device="cuda"))
    assert vae.host_creations == 1


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("experiment", ["pinning", "tensor_creation", "empty_cache", "sync"])
def test_cuda_only_tips_measure_on_cuda(tmp_path, experiment):
    tiny_cuda = [o for o in TINY if o != "device=cpu"] + ["device=cuda"]
    proc = run_cli(f"+experiment={experiment}", "model=[vae,transformer]", *tiny_cuda,
                   f"out_dir={tmp_path}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    trials = pd.read_csv(only_run_dir(tmp_path) / "trials.csv")
    assert (trials["status"] == "ok").all(), trials[["model", "variant", "status"]]
