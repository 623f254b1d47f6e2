"""python -m common.valuehead ...: see common/valuehead/cli.py."""

import sys

from common.valuehead.cli import main

sys.exit(main())
