"""The report over one or more sweeps: ``python -m mdl.report <folders>`` (build.py), read from the runs'
results (runs.py), compared per cell (stats.py), drawn (figures.py), set beside the paper (paper.py)."""
