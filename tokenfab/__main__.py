import sys

from tokenfab.cli import main

sys.exit(main())
