"""``python -m rtpcore``: the command line (rtpcore.cli)."""

import sys

from rtpcore.cli import main

if __name__ == "__main__":
    sys.exit(main())
