"""`python -m engine.prepare`: tokenize raw text into a token file (engine/cli/prepare.py)."""
import sys

from engine.cli.prepare import main

if __name__ == "__main__":
    sys.exit(main())
