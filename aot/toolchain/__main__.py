"""``python -m aot.toolchain ...`` (the same as ``python -m aot ...`` in a source checkout)."""

import sys

from .cli import main

sys.exit(main())
