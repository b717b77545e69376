"""The studies: what is measured and how a run's time is shared. A plan's study (study.py) runs
each model's phases (probes, forecasts, rounds, paired profile, largest batch) on one clock,
with the instrument (speedbench.measure: session, train, trial, timing, ...) doing the
measuring; time to target (to_target.py) trains the variants to a held-out loss."""
