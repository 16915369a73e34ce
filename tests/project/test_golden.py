"""The golden master: every plan of every README example and configs/*.yaml point, as
tests/golden/*.json.gz holds it, must be what the proxies plan now (tests/golden.py says what
a dump holds and how cases are found).

After a deliberate change to what a proxy sends, regenerate and commit the goldens:

    python tests/golden.py --update          # every case
    python tests/golden.py --update NAME     # one (names: python tests/golden.py --list)

Every golden file is checked, also one whose command has left the README or the sweeps: its
plans are still frozen until it is removed on purpose.
"""

from __future__ import annotations

import copy
import glob
import os
import re

import golden
import pytest

FILES = sorted(glob.glob(os.path.join(golden.GOLDEN_DIR, "*.json.gz")))
NAMES = [os.path.basename(f).removesuffix(".json.gz") for f in FILES]
# `slow` (out of the inner loop, still in the full suite), the cases that take seconds to
# plan and compare: a golden over 128 KiB (GPT-3's 96 GPipe stages on 768 ranks: 1 MB, 5 s,
# as much as all the others together; GPT-2 XL's 16,384 tokens over cp 8: 160,000 ops, 2.6 s
# of planning, while the README's gpt3-tiny cp 2 and cp 4 cases keep a cp plan in the loop)
# and the sweeps' GPT-3 175B points (configs/gpt3-*.yaml: 1 to 5 s each under load, half of
# what remains), and a sweep's points on more than 32 ranks: the same options planned again
# at a larger world (each sweep keeps its points up to 32 ranks in the loop:
# test_cases_come_from_the_readme_and_every_sweep). The README's 175B layouts stay in.
BIG = 128 * 1024
SWEEP_WORLD = 32


def world_of(name: str) -> int:
    return int(re.search(r"-n(\d+)-", name).group(1))


def slow_golden(path: str, name: str) -> bool:
    sweep_big = not name.startswith("readme-") and world_of(name) > SWEEP_WORLD
    return (
        os.path.getsize(path) > BIG
        or (name.startswith("gpt3-") and "model_gpt3_175b" in name)
        or sweep_big
    )


PARAMS = [
    pytest.param(n, marks=pytest.mark.slow) if slow_golden(f, n) else n
    for f, n in zip(FILES, NAMES, strict=True)
]

# Small cases written out here (not looked up in the README), so these tests do not depend
# on which examples the README shows.
GPIPE = golden.Case("gpt2", ("8", "4", "4", "--schedule", "gpipe", "--check"), 4, "README.md")
BUCKETS = golden.Case("gpt2", ("8", "2", "--grad-sync", "buckets", "--bucket-mb", "1"), 4, "-")
COSMO = golden.Case("cosmoflow", ("--model", "cosmoflow-tiny", "--shards", "4"), 4, "-")


@pytest.mark.parametrize("name", PARAMS)
def test_plans_equal_the_golden(name):
    stored = golden.read(golden.path_of(name))
    case = golden.case_from_golden(stored)
    assert case.name == name, "the file's name is not its case's: regenerate it"
    difference = golden.compare(stored, golden.dump(case), case.ignore_request_names)
    assert difference is None, f"{name}: {difference} (deliberate? {golden.REGEN} {name})"


def test_every_case_has_a_golden():
    missing = [c.name for c in golden.cases() if not os.path.isfile(golden.path_of(c.name))]
    assert not missing, f"no golden for {missing[0]} (and {len(missing) - 1} more): {golden.REGEN}"


def test_cases_come_from_the_readme_and_every_sweep():
    cases = golden.cases()
    sources = {c.source for c in cases}
    assert "README.md" in sources
    assert {os.path.basename(s) for s in sources if s != "README.md"} == {
        os.path.basename(p) for p in glob.glob(os.path.join(golden.ROOT, "configs", "*.yaml"))
    }
    assert {c.proxy for c in cases} == set(golden.PROXIES)
    # and every source but the GPT-3 175B sweeps keeps a golden out of `slow` (slow_golden)
    fast = {
        c.source
        for c in cases
        if os.path.isfile(golden.path_of(c.name))
        and not slow_golden(golden.path_of(c.name), c.name)
    }
    assert {c.source for c in cases if "model_gpt3_175b" not in c.name} <= fast
    # a sweep's machine file is named relative to the checkout, so goldens move with it
    assert all(not os.path.isabs(w) for c in cases for w in c.argv)


@pytest.mark.parametrize(
    "command, expected",
    [
        ("mpiexec -n 8 python -m proxies.gpt3 4 2 --tp 2", ("gpt3", ("4", "2", "--tp", "2"), 8)),
        (
            "python -m proxies.gpt2 36 4 8 --dry-run --world-size 8 --show-ranks 0,3",
            ("gpt2", ("36", "4", "8", "--show-ranks", "0,3"), 8),
        ),
        ("python -m proxies dlrm --dry-run --world-size=16", ("dlrm", (), 16)),
        ("python -m proxies.cosmoflow --shards 1", ("cosmoflow", ("--shards", "1"), 1)),
        ("mpiexec -n 2 proxies gpt2 2 2", ("gpt2", ("2", "2"), 2)),
        ("mpiexec -n 2 .venv/bin/proxies-dlrm --check", ("dlrm", ("--check",), 2)),
        ("python -m proxies.gpt2 --version", None),
        ("proxies-gpt3 --help", None),
        ("mpiexec -n 4 python -m proxies.collectives -b 8 -e 1M", None),
        ("python -m proxies compare a.json b.json", None),
        ("python -m proxies sweep configs/smoke.yaml", None),
        ("python -m proxies.gpt2.bench --steps 3", None),
        ("python benchmarks/gpt2_step.py --model gpt2-tiny", None),
    ],
)
def test_case_of_a_command(command, expected):
    c = golden.case_of(command, "README.md")
    assert (c and (c.proxy, c.argv, c.world)) == expected


def test_a_huge_world_dumps_one_rank_per_stage_and_a_witness():
    """GPT-3 175B at 12,288 ranks, Megatron order tp-dp-pp with tp 8, dp 96, pp 16: rank =
    tp + 8 dp + 768 pp, so the representatives (tp = dp = 0) are 768 s, and the witness the
    last rank. Every rank maps to the representative of its stage."""
    case = golden.Case(
        "gpt3", ("96", "16", "--tp", "8", "--order", "megatron", "--layers-only"), 12288, "-"
    )
    d = golden.dump(case)
    assert [e[0] for e in d["ranks"]] == [768 * s for s in range(16)] + [12287]
    assert d["folded"]["dims"] == ["tp", "dp"]
    rep = d["folded"]["representative"]
    assert len(rep) == 12288 and rep[767] == 0 and rep[768] == 768 and rep[12287] == 11520
    # the witness runs its stage's ops; only its groups (relative) and coordinates differ
    by_rank = {e[0]: e for e in d["ranks"]}
    assert by_rank[12287][1] == by_rank[11520][1]
    assert by_rank[12287][3] == {"tp": 7, "dp": 95, "pp": 15}


def changed(dump: dict, rank: int, edit) -> dict:
    """A copy of `dump` whose op list of `rank` went through `edit` (in place), stored under
    its new hash, as a golden taken from a plan that differed there would be."""
    out = copy.deepcopy(dump)
    entry = next(e for e in out["ranks"] if e[0] == rank)
    ops = copy.deepcopy(out["ops"][entry[1]])
    edit(ops)
    new = golden.digest(ops)
    out["ops"][new] = ops
    for e in out["ranks"]:
        if e[1] == entry[1]:
            e[1] = new
    return out


def test_a_changed_count_is_named():
    fresh = golden.dump(GPIPE)
    assert golden.compare(fresh, golden.dump(GPIPE)) is None
    ops = fresh["ops"][fresh["ranks"][1][1]]
    count = ops[0]["recvs"][0]["count"]  # stage 1 starts receiving micro-batch 0

    def edit(ops):
        ops[0]["recvs"][0]["count"] += 1

    # ranks 1 and 2 (middle stages) share one op list: rank 1 is named
    assert golden.compare(changed(fresh, 1, edit), fresh) == (
        f"rank 1: op 0 (P2P recv_forward): recvs[0].count: {count + 1} in the golden, {count} now"
    )


def test_a_changed_count_in_a_stored_golden_is_named():
    name = next(n for n in NAMES if n.startswith("readme-gpt2-n4-"))
    stored = golden.read(golden.path_of(name))
    case = golden.case_from_golden(stored)
    oid = stored["ranks"][-1][1]
    r = next(e[0] for e in stored["ranks"] if e[1] == oid)  # the first rank sharing its ops
    ops = stored["ops"][oid]
    i = next(i for i, op in enumerate(ops) if "count" in op)  # the first collective

    def edit(ops):
        ops[i]["count"] *= 2

    difference = golden.compare(changed(stored, r, edit), golden.dump(case))
    assert difference.startswith(f"rank {r}: op {i} (Collective {ops[i]['kind']}): count: ")
    assert difference.endswith(f"{2 * ops[i]['count']} in the golden, {ops[i]['count']} now")


def test_other_changes_are_named():
    fresh = golden.dump(GPIPE)
    assert golden.compare(changed(fresh, 0, lambda ops: ops.pop()), fresh).startswith(
        f"rank 0: {len(fresh['ops'][fresh['ranks'][0][1]]) - 1} ops in the golden, "
    )
    dtype = changed(fresh, 3, lambda ops: ops[0]["recvs"][0].update(dtype="bfloat16"))
    assert golden.compare(dtype, fresh) == (
        'rank 3: op 0 (P2P recv_forward): recvs[0].dtype: "bfloat16" in the golden, "float32" now'
    )
    moved = copy.deepcopy(fresh)
    moved["ranks"][2][3]["pp"] = 1
    assert golden.compare(moved, fresh) == "rank 2: coords.pp: 1 in the golden, 2 now"


def test_a_hand_edited_golden_is_refused():
    fresh = golden.dump(GPIPE)
    edited = copy.deepcopy(fresh)
    oid = edited["ranks"][0][1]
    edited["ops"][oid][0]["flops"] = 1.0  # the hash no longer matches: not a golden
    assert "does not match its hash" in golden.compare(edited, fresh)


def test_floats_to_a_relative_1e_12_and_types_exactly():
    assert golden.first_difference(1e12, 1e12 * (1 + 1e-15)) is None
    assert golden.first_difference(1e12, 1e12 * (1 + 1e-9)) is not None
    assert golden.first_difference(4096, 4096.0) == "4096 in the golden, 4096.0 now"
    assert golden.first_difference(1, True) is not None


@pytest.mark.parametrize("case", [BUCKETS, COSMO], ids=["gpt2-buckets", "cosmoflow"])
def test_request_names_are_ignored_only_when_asked(case):
    fresh = golden.dump(case)
    r, oid = next((e[0], e[1]) for e in fresh["ranks"] if "req" in str(fresh["ops"][e[1]]))
    first = next(op["req"] for op in fresh["ops"][oid] if "req" in op)

    def rename(ops):  # every use of the name, the start and its wait
        for op in ops:
            if op.get("req") == first:
                op["req"] = "renamed"

    def unpair(ops):  # only the last use: another wait, not a renaming
        last = max(i for i, op in enumerate(ops) if op.get("req") == first)
        ops[last]["req"] = "renamed"

    renamed = changed(fresh, r, rename)
    assert f'req: "{first}" in the golden, "renamed" now' in golden.compare(fresh, renamed)
    assert golden.compare(fresh, renamed, ignore_request_names=True) is None
    assert golden.compare(fresh, changed(fresh, r, unpair), ignore_request_names=True)


def test_cosmoflow_request_names_count_for_now():
    assert golden.IGNORE_REQUEST_NAMES == dict.fromkeys(golden.PROXIES, False)
