import sys

from rtpcore.cli import main

sys.exit(main())
