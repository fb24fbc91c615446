import sys

from memfit.cli.app import main

sys.exit(main())
