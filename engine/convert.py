"""`python -m engine.convert`: Hugging Face weights in and out (engine/cli/convert.py)."""
import sys

from engine.cli.convert import main

if __name__ == "__main__":
    sys.exit(main())
