"""`python -m swarm.cli`: the same as the `swarm` command (local swarms start their processes so)."""

import sys

from swarm.cli import main

sys.exit(main())
