"""Reports: figures (plots.py), markdown/HTML and console rendering (render.py), CLI (__main__.py)."""
