"""`python -m engine.launch`: run engine.train as N processes on one machine (engine/cli/launch.py)."""
import sys

from engine.cli.launch import main

if __name__ == "__main__":
    sys.exit(main())
