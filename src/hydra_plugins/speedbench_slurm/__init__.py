"""Where Hydra looks for launchers (it instantiates only classes defined in the `hydra_plugins`
package): speedbench's SLURM launcher (speedbench/slurm.py) for `hydra/launcher=slurm`. Without
Hydra's submitit plugin there is nothing to offer (speedbench's command line says what to
install)."""
try:
    from speedbench import slurm
except ImportError:
    slurm = None

if slurm is not None:
    class SweepLauncher(slurm.SweepLauncher):
        """speedbench.slurm.SweepLauncher, under the name Hydra accepts."""
