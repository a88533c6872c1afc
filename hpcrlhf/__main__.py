import sys

from hpcrlhf.cli import main

sys.exit(main())
