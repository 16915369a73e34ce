"""--fsdp on every transformer front end and with tp + sequence parallelism and cp, under
mpiexec (driver: tests/cp_driver.py, several runs per process group): real training equals
the one-process model (losses relative 1e-5), --check verifying every gather, reduce-scatter
and message. LLaMA (untied head) at dp 2, dp 4, pp 2 x dp 2, tp 2 x dp 2, tp 2 + SP x dp 2,
cp 2 x dp 2 (FSDP over the 4 dp x cp ranks, and HSDP 2 x 2 over them); GPT-3 at tp 2 + SP x
dp 2 and cp 2 x dp 2, GPT-2 at cp 2 x dp 2; BERT at dp 2, pp 2 x dp 2 (tied word embedding)
and tp 2 x dp 2."""

from __future__ import annotations

import pytest
from bert.test_model import TINY as BERT_TINY
from bert.test_model import emulate as bert_emulate
from llama.test_model import TINY as LLAMA_TINY
from llama.test_model import one_process as llama_one_process

from transformer.test_fsdp_mpi import COMMON, GPT3, drive, reference

pytestmark = pytest.mark.mpi  # every test here starts MPI

RUN = ["--iters", "2", "--warmup", "0", "--quiet", "--check", "--timeout", "120"]
LLAMA = ["llama", "--model", "llama-tiny", *LLAMA_TINY[2:], *RUN]
BERT = ["bert", *BERT_TINY[2:], *RUN]  # BERT_TINY: "2" "1" --model bert-tiny ...
SP = ["--tp", "2", "--sequence-parallel"]


def test_fsdp_on_2_ranks_llama_and_bert(tmp_path):
    """dp 2: LLaMA's units (wte; the layers; ln_f with the untied lm_head) and BERT's (wte;
    wpe, token types, embedding LN and MLM head; the layers)."""
    runs = [
        [LLAMA[0], "2", "1", *LLAMA[1:], "--fsdp", "--micro-batches", "2"],
        [BERT[0], "2", "1", *BERT[1:], "--fsdp", "--micro-batches", "2"],
    ]
    llama, bert = drive(tmp_path, 2, runs)
    assert llama["loss"] == pytest.approx(llama_one_process(2, 4)[0], rel=1e-5)
    assert bert["loss"] == pytest.approx(
        bert_emulate(["2", "1", *BERT_TINY[2:], "--micro-batches", "4"], 1), rel=1e-5
    )
    assert llama["config"]["fsdp_shard_size"] == 2 == bert["config"]["fsdp_shard_size"]
    assert set(llama["bytes"]) == {"fsdp_allgather", "fsdp_reduce_scatter"}


def test_fsdp_on_4_ranks_every_front_end_tp_sp_cp(tmp_path):
    """4 samples per iteration everywhere (8 for BERT: micro-batches of 2)."""
    m1, m2 = ["--micro-batches", "1"], ["--micro-batches", "2"]
    runs = [
        [LLAMA[0], "2", "1", *LLAMA[1:], "--fsdp", *m1],  # dp 4
        [LLAMA[0], "2", "2", *LLAMA[1:], "--fsdp", *m2],  # pp 2 x dp 2
        [LLAMA[0], "2", "1", *LLAMA[1:], "--fsdp", "--tp", "2", *m2],
        [LLAMA[0], "2", "1", *LLAMA[1:], "--fsdp", *SP, *m2],
        [LLAMA[0], "2", "1", *LLAMA[1:], "--fsdp", "--cp", "2", *m2],
        [LLAMA[0], "2", "1", *LLAMA[1:], "--fsdp", "--cp", "2", "--fsdp-shard-size", "2", *m2],
        [GPT3[0], "2", "1", *GPT3[1:], "--check", "--fsdp", *SP, *m2],
        [GPT3[0], "2", "1", *GPT3[1:], "--check", "--fsdp", "--cp", "2", *m2],
        [BERT[0], "2", "2", *BERT[1:], "--fsdp", *m2],  # pp 2 x dp 2
        [BERT[0], "2", "1", *BERT[1:], "--fsdp", "--tp", "2", *m2],
        [
            "gpt2",
            "2",
            "1",
            "2",
            "--model",
            "gpt2-tiny",
            "--fsdp",
            "--cp",
            "2",
            "--compute",
            "real",
            *COMMON,
        ],
    ]
    got = drive(tmp_path, 4, runs)
    llama = llama_one_process(2, 4)[0]
    bert = bert_emulate(["2", "1", *BERT_TINY[2:], "--micro-batches", "4"], 1)
    want = [llama] * 6 + [reference(4)] * 2 + [bert] * 2 + [reference(4)]
    for res, argv, w in zip(got, runs, want, strict=True):
        assert res["loss"] == pytest.approx(w, rel=1e-5), " ".join(argv)
    for k in (3, 6):  # SP: the layernorms' partial gradients summed over tp on the shards
        assert "tp_allreduce" in got[k]["bytes"], runs[k]
    assert got[4]["config"]["fsdp_shard_size"] == 4 == got[10]["config"]["fsdp_shard_size"]
    assert "hsdp_allreduce" in got[5]["bytes"] and "embed_allreduce" in got[8]["bytes"]
