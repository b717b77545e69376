"""expandable_segments: the variable merged into the trial's fresh process (CUDA), n/a with its
reason on a CPU."""
from __future__ import annotations

import pytest
import torch

from speedbench.techniques import Context
from speedbench.techniques.expandable_segments import ExpandableSegments, with_setting


def test_the_setting_keeps_the_users_other_options():
    assert with_setting("") == "expandable_segments:True"
    assert with_setting("max_split_size_mb:128,expandable_segments:False") == \
        "max_split_size_mb:128,expandable_segments:True"


def test_on_a_cpu_it_is_na_and_sets_nothing():
    recipe = type("R", (), {"expandable_segments": True})()
    cpu = Context(torch.device("cpu"))
    assert ExpandableSegments().not_applicable(recipe, cpu).startswith(
        "n/a: expandable_segments configures the CUDA caching allocator")
    assert ExpandableSegments().environment(recipe, cpu) == {}


@pytest.mark.gpu
def test_gpu_the_trials_process_runs_with_expandable_segments():
    from test_techniques import one_trial
    from speedbench.techniques.base import ActsOn

    got = one_trial(ActsOn(device="cuda"), {"expandable_segments": True}).record  # launched
    assert got["status"] == "ok", got["status"]
    assert "expandable_segments:True" in got["cuda_alloc_conf"]
