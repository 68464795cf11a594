import sys

from gateway.entry import main

sys.exit(main())
