"""``python -m fedefc_cli`` is ``fedefc`` (for an environment whose scripts are not on PATH)."""

import sys

try:
    from .main import main
except ModuleNotFoundError as err:  # an interpreter without the project's dependencies
    print(f"fedefc: {err} in {sys.executable}: this Python does not have the project "
          "installed. Activate the environment where it is (source .venv/bin/activate; "
          "docs/DEPLOYMENT.md, Install), or give the deploy/*.sh scripts its interpreter: "
          "PYTHON=/path/to/.venv/bin/python deploy/start-superlink.sh ...", file=sys.stderr)
    sys.exit(2)

if __name__ == "__main__":  # not when multiprocessing's spawn imports this module
    sys.exit(main())
