"""Every result carries its provenance and conforms to proxies/schema/result.schema.json:
dry runs (with --machine, so the prediction fields are checked too) and real 2-rank runs
of every proxy; the validator itself; launcher detection; --version on every entry point;
shipped configs found by name."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest
from launch import ROOT, mpiexec, mpirun, run

import proxies
from proxies import schema
from proxies.core import configs, provenance

# Tiny presets, one timed iteration: each run takes about a second on 2 cores.
REAL = {
    "gpt2": ["--iters", "1", "--warmup", "0"],
    "gpt3": ["--model", "gpt3-tiny", "--seq-len", "32", "--iters", "1", "--warmup", "0"],
    "cosmoflow": ["--model", "cosmoflow-tiny", "--global-batch", "2", "--shards", "2"]
    + ["--iters", "1", "--warmup", "0"],
    "dlrm": ["--model", "dlrm-tiny", "--iters", "1", "--warmup", "0"],
    "resnet": ["--iters", "1", "--warmup", "0"],
}
DRY = {"gpt2": [], "gpt3": ["--model", "gpt3-tiny"], "cosmoflow": [], "dlrm": []}
DRY["resnet"] = ["--model", "resnet50"]


def git_describe() -> str:
    out = subprocess.run(
        ["git", "-C", ROOT, "describe", "--always", "--dirty", "--tags"],
        capture_output=True,
        text=True,
    )
    return out.stdout.strip()


def assert_provenance(result: dict, launcher: str | None) -> None:
    assert result["schema_version"] == provenance.SCHEMA_VERSION == 1
    assert result["version"] == proxies.__version__
    assert result["commit"] == git_describe()  # these tests run from a checkout
    assert result["launcher"] == launcher
    assert result["host_count"] == len(result["hosts"]) == 1
    assert result["hosts"] == [socket.gethostname()]


# -- the validator ------------------------------------------------------------------------

SMALL = {
    "type": "object",
    "required": ["a"],
    "additionalProperties": False,
    "properties": {
        "a": {"type": "integer"},
        "b": {"type": ["string", "null"]},
        "c": {"type": "array", "items": {"type": "number"}},
        "d": {"type": "object", "additionalProperties": {"enum": [1, 2]}},
    },
}


def test_validator_accepts_and_names_each_problem():
    assert schema.validate({"a": 1, "b": None, "c": [1, 2.5], "d": {"x": 2}}, SMALL) == []
    assert schema.validate({"b": "s"}, SMALL) == ["$: missing 'a'"]
    assert schema.validate({"a": True}, SMALL) == ["$.a: expected integer, got bool"]
    assert schema.validate({"a": 1.0}, SMALL) == ["$.a: expected integer, got float"]
    assert schema.validate({"a": 1, "z": 0}, SMALL) == [
        "$: unexpected field 'z' (not in the schema)"
    ]
    assert schema.validate({"a": 1, "c": [1, "x", None]}, SMALL) == [
        "$.c[1]: expected number, got str",
        "$.c[2]: expected number, got NoneType",
    ]
    assert schema.validate({"a": 1, "d": {"x": 3}}, SMALL) == ["$.d.x: 3 is not one of [1, 2]"]
    assert schema.validate([], SMALL) == ["$: expected object, got list"]


def test_validator_refuses_keywords_it_does_not_check():
    with pytest.raises(ValueError, match="minimum"):
        schema.validate(3, {"type": "integer", "minimum": 5})


def test_schema_file_uses_only_checked_keywords_and_documents_every_field():
    s = schema.load()

    def walk(node):
        if isinstance(node, dict):
            assert set(node) <= set(schema.KEYWORDS) | set(schema.ANNOTATIONS), node
            for key in ("properties",):
                for sub in node.get(key, {}).values():
                    walk(sub)
            for key in ("items", "additionalProperties"):
                if isinstance(node.get(key), dict):
                    walk(node[key])

    walk(s)
    assert s["additionalProperties"] is False  # a new top-level field must be documented
    assert all(p.get("description") for p in s["properties"].values())


# -- provenance ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "env, want",
    [
        ({}, None),
        ({"PMI_RANK": "0", "PMI_FD": "5", "MPI_LOCALNRANKS": "2"}, "hydra"),
        ({"HYDI_CONTROL_FD": "7", "SLURM_PROCID": "0", "SLURM_STEP_ID": "1"}, "hydra"),
        ({"OMPI_COMM_WORLD_SIZE": "2", "PRTE_LAUNCHED": "1"}, "prterun"),
        ({"OMPI_COMM_WORLD_SIZE": "2"}, "orterun"),
        ({"SLURM_PROCID": "0", "SLURM_STEP_ID": "3", "PMI_RANK": "0"}, "srun"),
        ({"SLURM_PROCID": "0"}, None),  # a batch script's own variables: no launcher
        ({"PALS_RANKID": "0"}, "pals"),
    ],
)
def test_launcher_from_the_environment(env, want):
    assert provenance.launcher(env) == want


def test_hosts_unique_in_rank_order_and_capped():
    assert provenance.host_fields(["b", "a", "b", "a"]) == {"hosts": ["b", "a"], "host_count": 2}
    many = provenance.host_fields([f"n{i // 2}" for i in range(400)])
    assert many["host_count"] == 200
    assert many["hosts"] == [f"n{i}" for i in range(provenance.HOSTS_LISTED)]


def version_of(main, argv, capsys) -> str:
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 0
    return capsys.readouterr().out.strip()


@pytest.mark.slow
def test_version_on_every_entry_point(capsys):
    import importlib.util

    from proxies.calibrate.main import parser as calibrate
    from proxies.collectives.bench import parser as collectives
    from proxies.cosmoflow.proxy import parser as cosmoflow
    from proxies.dlrm.proxy import parser as dlrm
    from proxies.gpt2.proxy import parser as gpt2
    from proxies.gpt3.proxy import parser as gpt3
    from proxies.sweep import report, runner

    spec = importlib.util.spec_from_file_location(  # the step benchmark: a script
        "bench_gpt2_step", os.path.join(ROOT, "benchmarks", "gpt2_step.py")
    )
    step_bench = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # dataclasses
    spec.loader.exec_module(step_bench)
    gpt2_bench = step_bench.parser
    want = f"mpi-dl-proxies {proxies.__version__} (commit {git_describe()})"
    for make in (gpt2, gpt3, cosmoflow, dlrm, collectives, calibrate, gpt2_bench, runner.parser):
        assert version_of(make().parse_args, ["--version"], capsys) == want, make
    assert version_of(report.main, ["--version"], capsys) == want
    # Required arguments do not stand in the way (calibrate needs -o, sweep a file).
    r = run([sys.executable, "-m", "proxies", "--version"], timeout=60)
    assert (r.returncode, r.stdout.strip()) == (0, want)


def test_shipped_configs_found_from_any_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    top = os.path.join(ROOT, "configs")
    assert configs.root() == top
    want = os.path.join(top, "machines", "dgx-a100.yaml")
    assert configs.resolve("configs/machines/dgx-a100.yaml", "machines") == want
    assert configs.resolve("dgx-a100", "machines") == want
    assert configs.resolve("smoke") == os.path.join(top, "smoke.yaml")
    assert configs.resolve("no-such-machine", "machines") == "no-such-machine"
    (tmp_path / "dgx-a100").write_text("mine")  # the user's own file wins
    assert configs.resolve("dgx-a100", "machines") == "dgx-a100"
    assert "dgx-a100" in configs.shipped("machines") and "smoke" in configs.shipped()


# -- results ------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("proxy", sorted(DRY))
def test_dry_run_json_conforms(tmp_path, proxy):
    out = tmp_path / "dry.json"
    r = run(
        [sys.executable, "-m", f"proxies.{proxy}", *DRY[proxy], "--dry-run", "--world-size", "4"]
        + ["--machine", "dgx-a100", "--json", str(out)],
        cwd=str(tmp_path),  # the machine by name, from outside the checkout
        env={"PYTHONPATH": ROOT},  # this checkout's package, not an installed one
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    result = json.loads(out.read_text())
    assert schema.check(result) == []
    assert result["dry_run"] is True and "predicted_iter_time_s" in result
    assert_provenance(result, launcher=None)


@pytest.mark.mpi
@pytest.mark.parametrize("proxy", sorted(REAL))
def test_real_run_json_conforms(tmp_path, proxy):
    out = tmp_path / "run.json"
    r = mpirun(2, f"proxies.{proxy}", *REAL[proxy], "--quiet", "--json", str(out), timeout=180)
    assert r.returncode == 0, r.stderr
    result = json.loads(out.read_text())
    assert schema.check(result) == []
    assert result["world_size"] == 2 and "dry_run" not in result
    # The launcher as named by its environment: MPICH's hydra, or Open MPI's.
    assert_provenance(result, launcher=provenance.launcher(launcher_env()))


def launcher_env() -> dict[str, str]:
    """The environment mpiexec gives a rank (to name the launcher the test runs under)."""
    code = "import json, os; print(json.dumps(dict(os.environ)))"
    r = run([mpiexec(), "-n", "1", sys.executable, "-c", code], timeout=60)
    return json.loads(r.stdout)


@pytest.mark.slow
def test_result_that_breaks_the_schema_is_caught(tmp_path):
    out = tmp_path / "dry.json"
    r = run([sys.executable, "-m", "proxies.gpt2", "--dry-run", "--json", str(out)], timeout=120)
    assert r.returncode == 0, r.stderr
    result = json.loads(out.read_text())
    result["world_size"] = "4"
    del result["version"]
    result["undocumented"] = 1
    assert schema.check(result) == [
        "$: missing 'version'",
        "$.world_size: expected integer, got str",
        "$: unexpected field 'undocumented' (not in the schema)",
    ]


@pytest.mark.mpi
def test_collectives_rows_carry_provenance(tmp_path):
    out = tmp_path / "rows.json"
    args = ["-b", "8", "-e", "64", "-n", "2", "-w", "0", "--json", str(out)]
    r = mpirun(2, "proxies.collectives", *args)
    assert r.returncode == 0, r.stderr
    rows = json.loads(out.read_text())
    launcher = provenance.launcher(launcher_env())
    assert rows and all(row["mpi"]["library"] for row in rows)
    for row in rows:
        assert_provenance(row, launcher)
