"""``python -m dsa_aot ...``: the build toolchain's command line (a source checkout only; the wheel ships
neither this file nor dsa_aot.toolchain)."""

import sys

from dsa_aot.toolchain.cli import main

sys.exit(main())
