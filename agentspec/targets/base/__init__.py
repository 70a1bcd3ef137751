"""The target's shared basics, below everything else in :mod:`agentspec.targets`: what keys
files to a model and to the code that measured them (:mod:`.fingerprint`), the CPU's
identity and the one place thread counts change (:mod:`.cpu`), atomic JSON files
(:mod:`.files`) and the decode-step mode flag the kernels read (:mod:`.step_mode`).

Nothing here imports another part of the target."""
