"""`python -m apex.cli`, as `apex`."""

import sys

from apex.cli import main

sys.exit(main())
