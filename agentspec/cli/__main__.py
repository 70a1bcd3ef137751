"""``python -m agentspec.cli``: the same as the ``agentspec`` console script."""

from __future__ import annotations

import sys

from agentspec.cli.console import main

sys.exit(main())
