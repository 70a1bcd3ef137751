"""The target: the model being accelerated, as its parts, lowest first.

``base`` (fingerprints, the CPU and its threads, JSON files, the step mode flag) <
``kernels`` (quantized products) and ``cache`` (KV memory) < ``target_config`` (the
settings, data only) and ``snapshot`` (a shipped model's quantized weights on disk) <
``forward`` (the model over its cache) < ``cost`` and ``probes`` (each independent of the
other) < ``request`` (scoring, prefix reuse, the lock) < ``hf`` (the
:class:`~agentspec.targets.hf.HFTarget` that puts them together). ``.importlinter``
enforces the direction.
"""
