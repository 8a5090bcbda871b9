"""``python -m agent.cli``: the ``certchat`` console script."""

import sys

from agent.cli.main import main

sys.exit(main())
