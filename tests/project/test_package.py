"""The package as a user gets it: build the wheel, install it into a fresh venv, run the
console scripts from a folder outside the checkout.

The fresh venv sees this environment's dependencies (mpi4py, NumPy, the mpich wheel ...)
through a .pth line instead of downloading them; a .pth-added folder's own .pth files are
not run, so the checkout's editable install stays out and `proxies` is the wheel's. Building
needs setuptools' build backend: without build isolation when this environment can build
wheels, else pip fetches setuptools (about 6 s in all with a warm pip cache).
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile

import pytest
from launch import ROOT, mpiexec, run

import proxies
from proxies import schema


def build_wheel(dest: str, src: str) -> str:
    """The wheel of a clean copy of the tracked files (a build leaves build/ behind)."""
    files = subprocess.run(
        ["git", "-C", ROOT, "ls-files", "-co", "--exclude-standard"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    for f in files:
        if os.path.isfile(os.path.join(ROOT, f)):
            os.makedirs(os.path.join(src, os.path.dirname(f)), exist_ok=True)
            shutil.copy2(os.path.join(ROOT, f), os.path.join(src, f))
    base = [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", dest, src]
    errors = []
    for extra in (["--no-build-isolation"], []):
        r = run(base + extra, timeout=300, cwd=src)
        if r.returncode == 0:
            (wheel,) = glob.glob(os.path.join(dest, "*.whl"))
            return wheel
        errors.append(r.stderr[-2000:])
    raise AssertionError("pip wheel failed:\n" + "\n".join(errors))


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(wheel, venv bin folder, environment for running its scripts)."""
    tmp = tmp_path_factory.mktemp("package")
    wheel = build_wheel(str(tmp / "dist"), str(tmp / "src"))
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    py = str(venv / "bin" / "python")
    site = subprocess.run(
        [py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    with open(os.path.join(site, "deps-from-test-env.pth"), "w") as f:
        f.write(sysconfig.get_paths()["purelib"] + "\n")
    r = run(
        [sys.executable, "-m", "pip", "--python", py, "install", "--no-deps", "--no-index", wheel],
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    # The mpich wheel's libmpi lies in this environment's lib/, where mpi4py looks for it
    # under sys.prefix; the fresh venv has another prefix.
    lib = os.path.join(sys.prefix, "lib")
    env = {
        "PATH": f"{venv / 'bin'}:{os.environ['PATH']}",
        "LD_LIBRARY_PATH": ":".join(filter(None, [lib, os.environ.get("LD_LIBRARY_PATH")])),
        "PYTHONPATH": "",
    }
    return wheel, str(venv / "bin"), env, tmp


def script(installed, name: str, *args: str, mpi: int = 0, timeout: float = 120):
    wheel, bin_dir, env, tmp = installed
    cmd = [os.path.join(bin_dir, name), *args]
    if mpi:
        cmd = [mpiexec(), "-n", str(mpi), *cmd]
    return run(cmd, timeout=timeout, env=env, cwd=str(tmp))  # outside the checkout


@pytest.mark.slow
def test_wheel_holds_the_package_configs_schema_licence_and_scripts(installed):
    wheel = installed[0]
    assert os.path.basename(wheel) == f"mpi_dl_proxies-{proxies.__version__}-py3-none-any.whl"
    names = zipfile.ZipFile(wheel).namelist()
    for f in ("configs/smoke.yaml", "configs/machines/dgx-a100.yaml"):
        assert f"proxies/{f}" in names and os.path.isfile(os.path.join(ROOT, f))
    assert "proxies/schema/result.schema.json" in names
    info = f"mpi_dl_proxies-{proxies.__version__}.dist-info"
    # dist-info/LICENSE (older setuptools) or dist-info/licenses/LICENSE (PEP 639)
    assert {f"{info}/LICENSE", f"{info}/licenses/LICENSE"} & set(names)
    scripts = zipfile.ZipFile(wheel).read(f"{info}/entry_points.txt").decode()
    for s in ("proxies", "proxies-gpt2", "proxies-gpt3", "proxies-cosmoflow", "proxies-dlrm"):
        assert f"\n{s} = " in scripts
    assert "\nproxies-llama = " in scripts
    assert "\nproxies-resnet = proxies.resnet.proxy:entry" in scripts


@pytest.mark.mpi
def test_console_scripts_version(installed):
    for name in ("proxies", "proxies-gpt2", "proxies-dlrm"):
        r = script(installed, name, "--version")
        # Installed, not a checkout: no commit.
        assert (r.returncode, r.stdout.strip()) == (0, f"mpi-dl-proxies {proxies.__version__}")
    r = script(installed, "proxies", "sweep", "--version")
    assert r.stdout.strip() == f"mpi-dl-proxies {proxies.__version__}"


@pytest.mark.mpi
def test_console_script_dry_run_with_a_shipped_machine(installed):
    tmp = installed[3]
    out = tmp / "dry.json"
    r = script(
        installed,
        "proxies",
        "gpt2",
        "--dry-run",
        "--world-size",
        "4",
        "--machine",
        "configs/machines/dgx-a100.yaml",  # not in the current folder: the wheel's copy
        "--json",
        str(out),
    )
    assert r.returncode == 0, r.stderr
    result = json.loads(out.read_text())
    assert schema.check(result) == []
    assert result["commit"] is None and result["version"] == proxies.__version__
    assert "predicted_iter_time_s" in result
    # The wheel's package ran, not this checkout's.
    r = script(installed, "python", "-c", "import proxies; print(proxies.__file__)")
    assert str(tmp / "venv") in r.stdout


@pytest.mark.mpi
def test_console_script_runs_a_proxy_on_two_ranks(installed):
    tmp = installed[3]
    out = tmp / "run.json"
    r = script(
        installed, "proxies-dlrm", "--model", "dlrm-tiny", "--iters", "1", "--warmup", "0",
        "--quiet", "--json", str(out), mpi=2, timeout=180,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    result = json.loads(out.read_text())
    assert schema.check(result) == []
    assert result["world_size"] == 2 and len(result["loss"]) == 1


@pytest.mark.mpi
def test_shipped_sweep_file_from_any_folder(installed):
    r = script(installed, "proxies", "sweep", "configs/smoke.yaml", "--print-commands")
    assert r.returncode == 0, r.stderr
    assert "proxies.gpt2" in r.stdout
