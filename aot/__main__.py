"""``python -m aot ...``: the build toolchain's command line (a source checkout only; the wheel ships
neither this file nor aot.toolchain)."""

import sys

from aot.toolchain.cli import main

sys.exit(main())
