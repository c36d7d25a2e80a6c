"""The prequential engine: one protocol for every member, fits of one or several members, one driver.

Where to look: the rule every member follows (validate, keep the best, stop) is in ``protocol.py``;
how a fit of one member and a fit of several run are in ``single_fit.py`` and ``stacked_fit.py``;
the order of fits, resuming and the results are in ``driver.py`` (``train_runs``: a run alone is a pack of one).
"""
