"""Reports: figures (plots.py), one run's report (render.py), comparisons (compare.py),
loading runs (runs.py), Markdown/HTML output (document.py), CLI (__main__.py)."""
