"""`python -m engine.train`: train a model (engine/cli/train.py)."""
import sys

from engine.cli.train import main

if __name__ == "__main__":
    sys.exit(main())
