"""Running the model over a KV cache: the model and its cache (:mod:`.kv`), attention
without KV copies and with row-invariant decode products (:mod:`.attention`), the direct
decode step (:mod:`.decoder`), CUDA graphs (:mod:`.step_graph`) and the shape-stable
policy the forwards follow (:mod:`.shapes`). Imports the kernels and the cache layers;
the costs and probes sit above it."""
