"""What a forward costs: measured curves c(k, L) (:mod:`.costs`, :mod:`.cost_curves`),
the live correction on a loaded machine and its thread choice (:mod:`.live_cost`), and the
meter that times the target's forwards (:mod:`.cost_meter`). Sits above the forward and
kernels; independent of the probes."""
