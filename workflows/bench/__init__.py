"""The benchmark harness, the methods it compares, and the stand-alone benchmarks
(interleaved and mixed runs, verifiers, seeded sampling, the suffix index, vLLM)."""
