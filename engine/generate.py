"""`python -m engine.generate`: sample from a checkpoint (engine/cli/generate.py)."""
import sys

from engine.cli.generate import main

if __name__ == "__main__":
    sys.exit(main())
