"""Running one experiment: composing it from the config (experiment.py), its identity (identity.py),
its place in the run store and lock (storage.py), its loggers (loggers.py) and debug checks."""
