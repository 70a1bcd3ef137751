"""``python -m workflows.bench.gpu_check``: the GPU check (``scripts/gpu_check.sh``)."""

import sys

from workflows.bench.gpu_check.check import main

sys.exit(main())
