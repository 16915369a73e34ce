import sys

from proxies.sweep.runner import main

sys.exit(main())
