"""The prequential engine: one protocol for every member, every fit a stack of k >= 1 members, one driver.

Where to look: the rule every member follows (validate, keep the best, stop) is in ``protocol.py``;
how a fit runs is in ``stacked_fit.py`` (the protocol's loop) and ``stacked_runs.py`` (a fit of runs' members);
the order of fits, resuming and the results are in ``driver.py`` (``train_runs``: a run alone is a pack of one).
"""
