"""`python -m engine.plan`: rank layouts for a model and a mesh (engine/cli/plan.py)."""
import sys

from engine.cli.plan import main

if __name__ == "__main__":
    sys.exit(main())
