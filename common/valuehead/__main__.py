"""python -m critic_adapters.common.valuehead ...: see common/valuehead/cli.py."""

import sys

from .cli import main

sys.exit(main())
