import sys

from flipjax.train.cli import main

sys.exit(main())
