"""``python -m dualpath.cli ...``: how the engines, servers and benchmarks start each other."""

import sys

from dualpath.cli import main

sys.exit(main())
