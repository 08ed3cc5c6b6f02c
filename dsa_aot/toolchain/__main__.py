"""``python -m dsa_aot.toolchain ...`` (the same as ``python -m dsa_aot ...`` in a source checkout)."""

import sys

from .cli import main

sys.exit(main())
