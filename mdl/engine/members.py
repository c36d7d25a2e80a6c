"""How many members a fit trains: the words the config and the engine share, free of torch so that the
config checks that read them stay fast."""

AUTO = "auto"  # mdl.members_per_fit=auto: as many as fit in the device's memory (mdl.engine.memory)
