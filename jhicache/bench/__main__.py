"""`python -m jhicache.bench`: runs `command.main`."""

import sys

from jhicache.bench.command import main

if __name__ == "__main__":
    sys.exit(main())
