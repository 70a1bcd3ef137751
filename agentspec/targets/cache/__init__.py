"""KV memory, apart from the model: the growing cache layers a forward writes
(:mod:`.kv_cache`), the prefix store that keeps KV blocks between requests
(:mod:`.prefix_cache`) with its memory budget and disk copy (:mod:`.kv_spill`), and the
hidden-state rows kept beside blocks (:mod:`.block_features`). It never runs a forward."""
