"""A module whose import never ends (tests/workers/startup.py imports it)."""

import time

time.sleep(600)
