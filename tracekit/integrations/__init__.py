"""Where users already work: the pytest plugin, the notebook magic, Hugging Face Trainer and Lightning callbacks.

Each module imports its host library only when used; none is needed by tracekit itself.
"""
