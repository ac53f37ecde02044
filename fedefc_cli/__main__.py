"""``python -m fedefc_cli`` is ``fedefc`` (for an environment whose scripts are not on PATH)."""

import sys

from .main import main

if __name__ == "__main__":  # not when multiprocessing's spawn imports this module
    sys.exit(main())
