"""``python -m kvcanary``: the command line of :mod:`kvcanary.cli`."""

import sys

from kvcanary.cli import main

if __name__ == "__main__":
    sys.exit(main())
