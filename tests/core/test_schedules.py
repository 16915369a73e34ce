"""Pipeline schedules as data: golden orders, warm-up counts, validation, bubble formula."""

import pytest

from proxies.core.schedules import (
    SCHEDULES,
    Action,
    bubble_fraction,
    gpipe,
    interleaved_1f1b,
    one_f_one_b,
    parse_actions,
    validate_schedule,
)


def legal_grid():
    """(name, pp, m, v) for pp 1..8, m 1..16, v 1..3 wherever the schedule accepts them."""
    for name, fn in SCHEDULES.items():
        for v in (1, 2, 3):
            for pp in range(1, 9):
                for m in range(1, 17):
                    if v > 1 and (name != "interleaved" or m % pp):
                        continue
                    yield name, fn, pp, m, v


def show(actions):
    return " ".join(map(str, actions))


def test_action_str_and_parse():
    assert str(Action("F", 3)) == "F3"
    assert str(Action("B", 0)) == "B0"
    assert str(Action("B", 2, chunk=1)) == "1B2"
    for text in ("F3", "B0", "1F0", "12B7"):
        assert str(Action.parse(text)) == text
    with pytest.raises(ValueError, match="X3"):
        Action.parse("X3")
    with pytest.raises(ValueError):
        Action("X", 0)


def test_every_legal_schedule_validates():
    count = 0
    for _, fn, pp, m, v in legal_grid():
        validate_schedule([fn(pp, m, s, v) for s in range(pp)], m, v)
        count += 1
    assert count > 400


GOLDEN_GPIPE_PP4_M8 = "F0 F1 F2 F3 F4 F5 F6 F7 B0 B1 B2 B3 B4 B5 B6 B7"

GOLDEN_1F1B_PP4_M8 = [
    "F0 F1 F2 F3 B0 F4 B1 F5 B2 F6 B3 F7 B4 B5 B6 B7",
    "F0 F1 F2 B0 F3 B1 F4 B2 F5 B3 F6 B4 F7 B5 B6 B7",
    "F0 F1 B0 F2 B1 F3 B2 F4 B3 F5 B4 F6 B5 F7 B6 B7",
    "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7",
]


def test_gpipe_golden():
    for stage in range(4):
        assert show(gpipe(4, 8, stage)) == GOLDEN_GPIPE_PP4_M8


def test_1f1b_golden():
    assert [show(one_f_one_b(4, 8, s)) for s in range(4)] == GOLDEN_1F1B_PP4_M8
    assert one_f_one_b(4, 8, 0) == parse_actions(GOLDEN_1F1B_PP4_M8[0])


def test_1f1b_warmup_is_pp_minus_stage_minus_1():
    for pp in range(1, 9):
        for m in range(1, 17):
            for stage in range(pp):
                actions = one_f_one_b(pp, m, stage)
                first_b = next(i for i, a in enumerate(actions) if a.kind == "B")
                # the warm-up forwards, then (unless the warm-up took all m) one steady F
                warmup = min(pp - stage - 1, m)
                assert first_b == warmup + (warmup < m), (pp, m, stage)


# Megatron-LM's interleaved order at pp = 2, m = 4, v = 2 (8 forwards and 8 backwards per
# stage), derived by hand from its rules:
#   warm-up forwards = (pp - s - 1)*2 + (v - 1)*pp: 4 on stage 0, 2 on stage 1;
#   forward k -> chunk (k mod pp*v) // pp, mb (k // pp*v)*pp + k mod pp, i.e. in groups of
#   pp = 2 micro-batches per chunk: F0 F1 1F0 1F1 F2 F3 1F2 1F3;
#   backward k -> the same with the chunk reversed: 1B0 1B1 B0 B1 1B2 1B3 B2 B3;
#   after the warm-up, steady pairs (forward k + warm-up, backward k), then the remaining
#   backwards (cool-down).
GOLDEN_INTERLEAVED_PP2_M4_V2 = [
    "F0 F1 1F0 1F1 F2 1B0 F3 1B1 1F2 B0 1F3 B1 1B2 1B3 B2 B3",
    "F0 F1 1F0 1B0 1F1 1B1 F2 B0 F3 B1 1F2 1B2 1F3 1B3 B2 B3",
]


def test_interleaved_matches_megatron_order():
    assert [show(interleaved_1f1b(2, 4, s, 2)) for s in range(2)] == GOLDEN_INTERLEAVED_PP2_M4_V2


def test_interleaved_warmup_count():
    for pp in range(1, 9):
        for v in (2, 3):
            for m in range(pp, 17, pp):
                for stage in range(pp):
                    actions = interleaved_1f1b(pp, m, stage, v)
                    first_b = next(i for i, a in enumerate(actions) if a.kind == "B")
                    warmup = min((pp - stage - 1) * 2 + (v - 1) * pp, m * v)
                    assert first_b == warmup + (warmup < m * v), (pp, m, v, stage)


def test_interleaved_v1_is_1f1b_and_needs_no_divisibility():
    assert interleaved_1f1b(4, 7, 1, 1) == one_f_one_b(4, 7, 1)


def test_interleaved_rejects_m_not_multiple_of_pp():
    with pytest.raises(ValueError, match=r"m = 6.*pp = 4"):
        interleaved_1f1b(4, 6, 0, 2)


def test_bad_arguments():
    with pytest.raises(ValueError, match="stage = 4"):
        one_f_one_b(4, 8, 4)
    with pytest.raises(ValueError, match="v must be 1"):
        gpipe(4, 8, 0, 2)
    with pytest.raises(ValueError, match="m = 0"):
        one_f_one_b(4, 0, 0)


def test_validate_reports_problems_with_a_grid():
    good = [one_f_one_b(2, 2, s) for s in range(2)]
    validate_schedule(good, 2)
    bad = [parse_actions("F0 B1 F1 B0"), parse_actions("F0 F1 B0 F1")]
    with pytest.raises(ValueError) as info:
        validate_schedule(bad, 2)
    text = str(info.value)
    assert "stage 0 step 1 B1: backward before its forward" in text
    assert "stage 1 step 3 F1: repeats step 1" in text
    assert "stage 1: missing B1" in text
    assert "Step | Rank 0 Rank 1" in text
    assert "   1 | B1     F1" in text
    with pytest.raises(ValueError, match="chunk must be in 0..0"):
        validate_schedule([parse_actions("1F0 1B0")], 1)


def test_bubble_fraction():
    assert bubble_fraction(4, 8) == 3 / 8
    assert bubble_fraction(4, 8, 2) == 3 / 16
    assert bubble_fraction(1, 5) == 0
