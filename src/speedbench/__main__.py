"""`python -m speedbench +experiment=NAME [overrides]`: Hydra composes the config, run() does the rest."""
from __future__ import annotations

import os
import sys

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from speedbench.config import ConfigError, config_dir, register_schema

register_schema()


@hydra.main(version_base="1.3", config_path=config_dir(), config_name="config")
def main(cfg: DictConfig) -> None:
    from speedbench.run import run

    experiment = HydraConfig.get().runtime.choices.get("experiment")
    try:
        run(cfg, experiment, overrides=list(HydraConfig.get().overrides.task))
    except (ConfigError, FileExistsError) as exc:
        if os.environ.get("RANK", "0") == "0":  # under torchrun every rank fails alike: say it once
            print(f"speedbench: error: {exc}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
    from speedbench import distributed

    distributed.exit_cleanly()  # under torchrun: leave without torch's teardown at finalization
