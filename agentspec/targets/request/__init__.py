"""Per-request parts of a target: scoring a request's tokens with prefix reuse
(:mod:`.scoring`, :mod:`.reuse`) and the lock that serialises requests on one model
(:mod:`.lock`)."""
