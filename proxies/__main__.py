"""python -m proxies PROXY [ARGS]: the same as python -m proxies.PROXY [ARGS]."""

import runpy
import sys

PROXIES = {"gpt2": "GPT-2, pipeline x data parallelism, real NumPy training"}


def main() -> None:
    if len(sys.argv) < 2 or sys.argv[1] not in PROXIES:
        if len(sys.argv) >= 2 and sys.argv[1] not in ("-h", "--help"):
            print(f"proxies: error: unknown proxy {sys.argv[1]!r}", file=sys.stderr)
            code = 2
        else:
            code = 0
        print("usage: python -m proxies PROXY [ARGS]   (or python -m proxies.PROXY [ARGS])\n")
        for name, what in PROXIES.items():
            print(f"  {name:10} {what}")
        sys.exit(code)
    name = sys.argv.pop(1)
    sys.argv[0] = f"proxies.{name}"
    runpy.run_module(f"proxies.{name}", run_name="__main__", alter_sys=True)


main()
