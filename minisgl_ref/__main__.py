import sys

from minisgl_ref.cli import main

sys.exit(main())
