"""``python -m inferlb``: the same as the ``inferlb`` command."""

import sys

from inferlb.cli import main

sys.exit(main())
