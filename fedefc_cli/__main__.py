"""``python -m fedefc_cli`` is ``fedefc`` (for an environment whose scripts are not on PATH)."""

import sys

from .main import main

sys.exit(main())
