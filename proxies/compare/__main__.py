import sys

from proxies.compare.command import main

sys.exit(main())
