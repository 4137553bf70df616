import sys

from apex.cli import main

sys.exit(main())
