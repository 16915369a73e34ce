"""python -m proxies COMMAND [ARGS]: the same as python -m proxies.COMMAND [ARGS]."""

import runpy
import sys

from proxies.registry import available


def main() -> None:
    commands = available()
    if sys.argv[1:2] == ["--version"]:
        from proxies.core import provenance

        print(provenance.version_text())
        sys.exit(0)
    if len(sys.argv) < 2 or sys.argv[1] not in commands:
        code = 0
        if len(sys.argv) >= 2 and sys.argv[1] not in ("-h", "--help"):
            print(f"proxies: error: unknown command {sys.argv[1]!r}", file=sys.stderr)
            code = 2
        print("usage: python -m proxies COMMAND [ARGS]   (or python -m proxies.COMMAND [ARGS])\n")
        for name, what in commands.items():
            print(f"  {name:12} {what}")
        sys.exit(code)
    name = sys.argv.pop(1)
    sys.argv[0] = f"proxies.{name}"
    runpy.run_module(f"proxies.{name}", run_name="__main__", alter_sys=True)


if __name__ == "__main__":  # python -m proxies; the console script `proxies` calls main()
    main()
