"""Settings for every test process (and the subprocesses the tests start, which inherit them):
WEDLM_COMPILE_CACHE=off. The command-line programs turn on JAX's persistent compilation cache by
default; the tests that count compiles must see them, so it is off unless a test names a folder.
"""

import os

os.environ.setdefault("WEDLM_COMPILE_CACHE", "off")
