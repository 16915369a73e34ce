#!/usr/bin/env bash
# One entry point for a fresh machine with only Python:
#   ./dev.sh run  [PROXY ARGS]   create .venv if needed, run GPT-2 on 4 ranks
#   ./dev.sh test [PYTEST ARGS]  create .venv if needed, run the test suite
# MPI comes from PyPI (the mpich wheel) unless PROXIES_MPI=system, which builds
# mpi4py against the mpicc on PATH (Open MPI, Cray MPICH, Intel MPI ...).
set -euo pipefail
cd "$(dirname "$0")"
VENV=${PROXIES_VENV:-.venv}
PY=${PYTHON:-python3}

setup() {
    if [ ! -x "$VENV/bin/python" ]; then
        echo "dev.sh: creating $VENV" >&2
        "$PY" -m venv "$VENV"
    fi
    # Reinstall only when pyproject.toml changed since the last install.
    local stamp="$VENV/.proxies-installed"
    if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
        if [ "${PROXIES_MPI:-wheel}" = system ]; then
            "$VENV/bin/pip" install -q --no-binary=mpi4py mpi4py
            "$VENV/bin/pip" install -q -e '.[test,plots]'
        else
            "$VENV/bin/pip" install -q -e '.[mpich,test,plots]'
        fi
        touch "$stamp"
    fi
    export PATH="$PWD/$VENV/bin:$PATH"
}

cmd=${1:-run}
shift || true
case "$cmd" in
    run)
        setup
        exec mpiexec -n 4 python -m proxies.gpt2 8 2 "$@"
        ;;
    test)
        setup
        exec python -m pytest "$@"
        ;;
    *)
        echo "usage: ./dev.sh run [proxy args] | ./dev.sh test [pytest args]" >&2
        exit 2
        ;;
esac
