"""Running one experiment: composing it from the config (experiment.py), its identity (identity.py),
its place in the run store and lock (storage.py), its loggers (loggers.py) and debug checks; runs trained
together (pack.py) and each one's own log file among them (job_logs.py)."""
