"""Bad input as one line: the error every CLI reports with exit code 2, and the argparse
parser and help formatter that keep it so."""
from __future__ import annotations

import argparse


class UsageError(Exception):
    """Bad input: reported as one line, exit code 2."""


class OneLineParser(argparse.ArgumentParser):
    """argparse whose errors raise UsageError (one line, exit 2) instead of printing usage."""

    def error(self, message):
        raise UsageError(message)


class DefaultsFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows "(default: X)" after a flag's help, except when there is no default to show
    (None, a flag that is off) or the help already says what the default is."""

    def _get_help_string(self, action):
        text = action.help or ""
        if (any(action.default is v for v in (None, False, argparse.SUPPRESS))
                or action.default == [] or "default" in text):
            return text
        return super()._get_help_string(action)
