import sys

from proxies.sweep.report import main

sys.exit(main())
