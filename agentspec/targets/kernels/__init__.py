"""The products a forward runs, below the forward: the quantized linear layers (``int8``
weight-only; ``w8a8`` / ``w8a16`` integer sums, exact whatever the kernel, row count or
thread count), their C digit kernel built at install, the fp32 product forms, and which
precision ``auto`` picks. Nothing here imports the forward, the cache or the costs."""
