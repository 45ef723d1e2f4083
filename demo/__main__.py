"""`python -m demo` (what `make demo` runs): see demo/run.py."""
import sys

from demo.run import main

sys.exit(main())
