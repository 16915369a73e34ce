"""python -m proxies COMMAND [ARGS]: the same as python -m proxies.COMMAND [ARGS]."""

import importlib.util
import runpy
import sys

COMMANDS = {
    "gpt2": "GPT-2: pipeline x data parallelism, real NumPy training",
    "gpt3": "GPT-3 (+MoE): data x tensor x pipeline (x expert) parallelism",
    "cosmoflow": "CosmoFlow: 3D CNN, spatial x data parallelism",
    "dlrm": "DLRM: model-parallel embeddings x data-parallel MLPs",
    "collectives": "allreduce algorithms benchmark (nccl-tests style table)",
    "sweep": "run a YAML scaling sweep",
    "report": "tables and plots of a sweep's results",
    "compare": "is B faster than A: two results or sweeps, per category, noise stated",
    "calibrate": "measure this allocation and write a machine file (--machine)",
}


def available() -> dict[str, str]:
    def runnable(name: str) -> bool:
        try:
            return importlib.util.find_spec(f"proxies.{name}.__main__") is not None
        except ModuleNotFoundError:
            return False

    return {k: v for k, v in COMMANDS.items() if runnable(k)}


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
