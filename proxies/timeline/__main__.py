import sys

from proxies.core.cli import run_main
from proxies.timeline.command import PROG, main

run_main(PROG, main)
sys.exit(0)
