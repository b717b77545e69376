"""Reports: figures (plots.py, waterfall.py, host_sweep.py), one run's report (render.py),
comparisons (compare.py), Markdown/HTML output (document.py), CLI (__main__.py). Run
directories are read through speedbench.results.runs."""
