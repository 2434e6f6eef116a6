"""``python -m bench``: run the benchmark suite (see bench/run.py)."""

import sys

from bench.run import main

sys.exit(main())
