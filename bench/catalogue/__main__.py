"""``python3 -m bench.catalogue``: the same as ``bench/catalogue/run.py``."""

import sys

from .run import main

sys.exit(main())
