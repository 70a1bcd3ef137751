"""Load-time probes of the model's own kernels and what they decide: whether a row's bits
depend on the row count or the thread count (:mod:`.products`), whether decode attention's
do (:mod:`.attention_rows`), below how many rows a prompt's do not (:mod:`.prompt`), the
shape policy built from the answers (:mod:`.policy`), and the answers kept between loads
(:mod:`.probe_cache`). Sits above the forward and kernels; independent of the costs."""
