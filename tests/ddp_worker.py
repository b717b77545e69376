"""DDP training through speedbench's own pieces, run by torchrun from test_distributed.py.

`python -m torch.distributed.run --nproc_per_node=2 tests/ddp_worker.py OUT_DIR` writes, from
rank 0: OUT_DIR/ddp.pt (weights after 3 DDP steps of a per-rank batch of 4) and
OUT_DIR/allreduce_calls.json (all-reduce calls over 2 optimizer steps with accumulate 1 and 3).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from omegaconf import OmegaConf
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

from speedbench import distributed, techniques
from speedbench.config import ModelSpec, Schema
from speedbench.measure.data import MarkovTokens, build_loader
from speedbench.techniques import Context
from speedbench.techniques.parallel import wrap
from speedbench.measure.train import Trainer, build_model

from dist_models import SEQ, TINY_LM, VOCAB

CPU = torch.device("cpu")
SPEC = ModelSpec(name="tiny", target={"_target_": TINY_LM["_target_"]}, dataset=TINY_LM["dataset"],
                 loss="cross_entropy", batch_size=4)


def train(env: distributed.DistEnv, parallel: str, batch: int, steps: int, accumulate: int = 1,
          hook=None) -> torch.nn.Module:
    """`steps` optimizer steps of speedbench's Trainer on the shard of `env`'s rank."""
    recipe = OmegaConf.structured(Schema)
    recipe.accumulate, recipe.lr = accumulate, 0.01
    data = MarkovTokens(256, SEQ, VOCAB)
    loader = build_loader(data, batch, techniques.loader_options(recipe, Context(CPU)), seed=0,
                          sampler=distributed.sampler(data, env, 0))
    model = wrap(build_model(SPEC, seed=0), parallel, CPU)
    if hook is not None:
        model.register_comm_hook(None, hook)
    trainer = Trainer(SPEC, recipe, CPU, loader, model=model)
    for _ in range(steps):
        trainer.step()
    trainer.close()
    return getattr(model, "module", model)


def main(out: Path) -> None:
    env = distributed.from_environ()
    distributed.init_process_group(env, CPU, timeout_s=60)
    model = train(env, "ddp", batch=4, steps=3)
    calls = {}
    for k in (1, 3):
        count = [0]

        def counting_hook(state, bucket, count=count):
            count[0] += 1
            return allreduce_hook(state, bucket)

        train(env, "ddp", batch=4, steps=2, accumulate=k, hook=counting_hook)
        calls[k] = count[0]
    if env.rank == 0:
        torch.save(model.state_dict(), out / "ddp.pt")
        (out / "allreduce_calls.json").write_text(json.dumps(calls))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
