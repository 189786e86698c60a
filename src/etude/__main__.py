"""``python -m etude`` (what ``torchrun -m etude`` runs) is the ``etude`` command."""

import sys

from etude.cli import main

sys.exit(main())
