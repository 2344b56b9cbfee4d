import sys

from .recipe import main

sys.exit(main())
