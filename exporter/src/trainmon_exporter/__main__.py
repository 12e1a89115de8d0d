"""``python -m trainmon_exporter``."""

import sys

from trainmon_exporter.cli import main

sys.exit(main())
