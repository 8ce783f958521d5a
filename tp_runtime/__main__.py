import sys

from tp_runtime.cli import main

sys.exit(main())
