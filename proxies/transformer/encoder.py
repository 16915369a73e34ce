"""BERT's own parts of the one transformer: the encoder configuration, its embeddings (word,
learned position, token type, embedding LayerNorm) and the masked-LM head (dense C x C +
GELU + LayerNorm, then the decoder tied to the word embeddings plus an output bias), with the
loss on the masked positions only. Attention is StageShard's (model.py) with causal=False:
every query attends to every key.

The layers are post-LN by default, as BERT's (LayerNorm after each residual add, no final
LayerNorm: postnorm.py), or pre-LN (cfg.norm "pre": StageShard's own layers, LayerNorm
before attention and MLP and a final ln_f before the head). Same tensors per layer
(12C^2 + 13C), same messages and FLOPs; pre-LN holds 2C more (ln_f).

Tensor parallelism as the GPT family's: the word embedding and the decoder (and its output
bias) are split over the vocabulary; the MLM transform (dense, GELU, LayerNorm) is small
(C x C) and replicated: every TP rank computes it whole, from the top layer's output
(after ln_f, pre-LN) forward and from the allreduced input gradient of the decoder
backward (the same collectives as GPT's head: no message is added). Sequence and context
parallelism are not supported (the proxy refuses them).

Masking (BERT's recipe, Devlin et al. 2019): per sample, round(0.15 T) positions (at least
one) drawn from (seed, sample); of them 80% become [MASK] (id 103), 10% a random token, 10%
stay; the targets are the original tokens there and -1 elsewhere. Token types: the first
half of a sample is segment A (0), the rest B (1). A micro-batch's loss is the mean over its
masked positions; each micro-batch has the same count, so the iteration's mean is the mean
over all of them, whatever the parallel layout.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from proxies.transformer.config import normal
from proxies.transformer.model import StageShard
from proxies.transformer.postnorm import PostNormPieces
from proxies.transformer.runtime import Runtime
from proxies.transformer.setup import GPT3Config, Setup
from proxies.transformer.state import ChunkActs

NORMS = ("post", "pre")
MASK_ID = 103  # [MASK] in bert-base-uncased's WordPiece vocabulary
MASK_RATE = 0.15
TYPE_VOCAB = 2  # token types (segments A and B)
# Layout sections (Setup.param_order): GPT-3's extras first, then BERT's, then the layers.
BERT_ORDER = ("wte", "wpe", "emb", "ln_f", "mlm", "layers")


@dataclass(frozen=True)
class BertConfig(GPT3Config):
    """BERT's encoder: 512 learned positions, the WordPiece vocabulary, no causal mask."""

    vocab_size: int = 30522
    max_seq_len: int = 512
    causal: bool = False
    norm: str = "post"  # "post": BERT's LayerNorm after each residual add; "pre": GPT's

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.norm not in NORMS:
            raise ValueError(f"norm must be one of {NORMS}, got {self.norm!r}")

    def extra_sections(
        self, vocab_local: int, embed: bool, head: bool
    ) -> dict[str, list[tuple[str, tuple[int, ...]]]]:
        C = self.n_embd
        emb = [("tte", (TYPE_VOCAB, C)), ("ln_e.weight", (C,)), ("ln_e.bias", (C,))]
        mlm = [
            ("mlm.dense.weight", (C, C)),
            ("mlm.dense.bias", (C,)),
            ("mlm.ln.weight", (C,)),
            ("mlm.ln.bias", (C,)),
            ("mlm.bias", (vocab_local,)),  # the decoder's output bias, split as wte
        ]
        out = {"emb": emb if embed else [], "mlm": mlm if head else []}
        if self.norm == "post":
            out["ln_f"] = []  # post-LN has no final LayerNorm
        return out

    @property
    def embedding_params(self) -> int:
        """Word, position and token-type embeddings and their LayerNorm."""
        C = self.n_embd
        return (self.vocab_size + self.max_seq_len + TYPE_VOCAB) * C + 2 * C

    @property
    def pooler_params(self) -> int:
        """The pooler (dense C x C + bias on [CLS]): in HF's BertModel, not in this proxy."""
        return self.n_embd * self.n_embd + self.n_embd

    @property
    def bert_model_params(self) -> int:
        """HF BertModel's count (embeddings, layers, pooler): bert-base-uncased 109,482,240."""
        return self.embedding_params + self.n_layer * self.layer_params + self.pooler_params

    @property
    def num_params(self) -> int:
        """What the proxy holds: embeddings, layers, the pre-LN final LayerNorm (2C) and the
        MLM head (C^2 + C dense, 2C LayerNorm, V output bias; the decoder is tied to wte).
        No pooler and no next-sentence head."""
        C = self.n_embd
        head = C * C + 3 * C + self.vocab_size
        lnf = 2 * C if self.norm == "pre" else 0
        return self.embedding_params + self.n_layer * self.layer_params + lnf + head


PRESETS: dict[str, BertConfig] = {
    c.name: c
    for c in (
        BertConfig("bert-base", 12, 768, 12),
        BertConfig("bert-large", 24, 1024, 16),
        # tests: the real vocabulary, 4 heads (tp 1, 2, 4), a short context
        BertConfig("bert-tiny", 4, 64, 4, max_seq_len=128),
    )
}


def mask_tokens(tokens: np.ndarray, seed: int, first_sample: int, vocab: int):
    """BERT's masking of (B,T) tokens: (inputs, targets), targets -1 where not masked.
    Sample b's choice depends only on (seed, first_sample + b): every layout agrees."""
    B, T = tokens.shape
    k = masked_per_sample(T)
    inputs, targets = tokens.copy(), np.full_like(tokens, -1)
    mask_id = MASK_ID if MASK_ID < vocab else vocab - 1  # a test's small vocabulary
    for b in range(B):
        rng = np.random.default_rng([seed, 11, first_sample + b])
        pos = rng.choice(T, size=k, replace=False)
        targets[b, pos] = tokens[b, pos]
        u = rng.random(k)
        inputs[b, pos[u < 0.8]] = mask_id
        rand = pos[(u >= 0.8) & (u < 0.9)]
        inputs[b, rand] = rng.integers(0, vocab, rand.size)
    return inputs, targets


def masked_per_sample(T: int) -> int:
    return max(1, round(MASK_RATE * T))


def token_types(T: int) -> np.ndarray:
    """(T,) segment ids: A (0) for the first half, B (1) for the rest."""
    return (np.arange(T) >= T // 2).astype(np.intp)


class BertShard(PostNormPieces, StageShard):
    """StageShard with BERT's embeddings and masked-LM head (see the module docstring)."""

    def __init__(self, S: Setup, *args, **kwargs) -> None:
        if S.sp or S.cp > 1 or S.moe:
            raise ValueError(
                "BERT's real compute supports neither sequence/context parallelism nor MoE"
            )
        super().__init__(S, *args, **kwargs)
        self.types = token_types(S.T)

    def _init_params(self, seed: int) -> None:
        super()._init_params(seed)
        w = self.w
        if "tte" in w:
            normal(w["tte"], np.random.default_rng([seed, 0, 2]), 0.02)
            w["ln_e.weight"].fill(1.0)
        if "mlm.dense.weight" in w:
            normal(w["mlm.dense.weight"], np.random.default_rng([seed, 0, 3]), 0.02)
            w["mlm.ln.weight"].fill(1.0)

    def _alloc(self, c: int) -> ChunkActs:
        st = super()._alloc(c)
        S, ch = self.S, self.chunks[c]
        shape = (S.B, S.T, S.cfg.n_embd)
        if ch.embed:  # the summed embeddings and their LayerNorm statistics
            st.emb = np.empty(shape, self.dtype)
            st.emb_mean, st.emb_rstd = (
                np.empty(shape[:2], self.dtype),
                np.empty(shape[:2], self.dtype),
            )
        if ch.head:  # st.lnf is the decoder's input (mlm.ln's output); ln_f's goes here
            st.mlm_in, st.mlm_pre, st.mlm_act = (np.empty(shape, self.dtype) for _ in range(3))
            st.mlm_mean, st.mlm_rstd = (
                np.empty(shape[:2], self.dtype),
                np.empty(shape[:2], self.dtype),
            )
        return st

    # ------------------------------------------------------------------------------------
    # embeddings

    def _chunk_input(self, st: ChunkActs, ch, mb: int) -> np.ndarray:
        """x0 = LayerNorm(word (allreduced) + position + token type)."""
        if not ch.embed:
            return super()._chunk_input(st, ch, mb)
        w, T = self.w, self.S.T
        np.add(self._full(), w["wpe"][:T], out=st.emb)
        st.emb += w["tte"][self.types]
        self.k.layernorm_forward(
            st.x0, st.emb_mean, st.emb_rstd, st.emb, w["ln_e.weight"], w["ln_e.bias"]
        )
        return st.x0

    def _embed_backward(self, st: ChunkActs, ch, mb: int, d: np.ndarray) -> None:
        """Through the embedding LayerNorm, the token types, then wpe and wte (the GPT
        embedding's backward)."""
        w, g = self.w, self.g
        de = self.scratch("demb", *st.emb.shape)
        de.fill(0)  # layernorm_backward adds
        self.k.layernorm_backward(
            de, g["ln_e.weight"], g["ln_e.bias"], d, st.emb, w["ln_e.weight"],
            st.emb_mean, st.emb_rstd, self._fresh("ln_e.weight"),
        )  # fmt: skip
        per_type = np.stack([de[:, self.types == t].sum(axis=(0, 1)) for t in range(TYPE_VOCAB)])
        if self._fresh("tte"):
            g["tte"][...] = per_type
        else:
            g["tte"] += per_type
        super()._embed_backward(st, ch, mb, de)

    # ------------------------------------------------------------------------------------
    # the masked-LM head

    def _fwd_lnf(self, st: ChunkActs, ch, mb: int) -> None:
        """ln_f (pre-LN only), then the transform: st.lnf = LayerNorm(GELU(dense(x)))."""
        w, k = self.w, self.k
        x = self._finish_mlp(st, ch.layers[-1])
        if self.post:
            st.mlm_in[...] = x
        else:
            k.layernorm_forward(
                st.mlm_in, st.lnf_mean, st.lnf_rstd, x, w["ln_f.weight"], w["ln_f.bias"]
            )
        k.matmul_forward(st.mlm_pre, st.mlm_in, w["mlm.dense.weight"], w["mlm.dense.bias"])
        k.gelu_forward(st.mlm_act, st.mlm_pre)
        k.layernorm_forward(
            st.lnf, st.mlm_mean, st.mlm_rstd, st.mlm_act, w["mlm.ln.weight"], w["mlm.ln.bias"]
        )

    def _logit_chunks(self, x: np.ndarray, W: np.ndarray, into: np.ndarray | None = None):
        """GPT's logits plus the decoder's output bias (this rank's slice)."""
        bias = self.w["mlm.bias"][: self.valid]
        for i, n, logits in super()._logit_chunks(x, W, into):
            logits += bias
            yield i, n, logits

    def _fwd_loss(self, st: ChunkActs, ch, mb: int) -> float:
        """The mean cross-entropy over the masked positions only."""
        super()._fwd_loss(st, ch, mb)
        S = self.S
        tl = self.ce_buf.reshape(S.tp, 3, S.N)[:, 2].astype(np.float64).sum(axis=0)
        m = st.targets.reshape(-1) >= 0
        return float((st.lse.reshape(-1)[m] - tl[m]).mean())

    def _bwd_head(self, st: ChunkActs, ch, mb: int) -> None:
        """dlogits = (softmax - onehot) * scale / (masked count) on the masked rows, 0 on
        the others; the decoder's partial input gradient into tp_buf, the gradients of this
        slice of wte (tied) and of the output bias."""
        S, C = self.S, self.S.cfg.n_embd
        x = st.lnf.reshape(-1, C)
        targets = st.targets.reshape(-1)
        t = targets - self.lo
        lse = st.lse.reshape(-1)
        masked = targets >= 0
        row = np.where(masked, float(st.loss_scale) / max(1, int(masked.sum())), 0.0)
        row = row.astype(self.dtype)
        out = self._full().reshape(-1, C)
        W, dW = self.w["wte"][: self.valid], self.g["wte"][: self.valid]
        db = self.g["mlm.bias"]
        fresh = self._fresh("wte")
        if fresh:  # padding rows get no gradient
            self.g["wte"][self.valid :] = 0
        fresh_b = self._fresh("mlm.bias")
        if fresh_b:
            db.fill(0)
        kept = st.probs is not None
        chunks = [(0, S.N, st.probs)] if kept else self._logit_chunks(x, W)
        for i, n, dlogits in chunks:

            def dlogits_of(lo: int, hi: int, i: int = i, dlogits: np.ndarray = dlogits) -> None:
                z, a, b = dlogits[lo:hi], i + lo, i + hi
                if kept:  # exp(logits - mx) kept: the softmax is that times exp(mx - lse)
                    z *= (np.exp(st.mx[a:b] - lse[a:b]) * row[a:b])[:, None]
                else:
                    z -= lse[a:b, None]
                    np.exp(z, out=z)
                    z *= row[a:b, None]
                tt = t[a:b]
                mine = (tt >= 0) & (tt < self.valid)
                z[np.arange(hi - lo)[mine], tt[mine]] -= row[a:b][mine]

            self._rows(dlogits_of, n)
            db[: self.valid] += dlogits.sum(axis=0)
            self.k.matmul_backward(
                out[i : i + n], dW, None, dlogits, x[i : i + n], W, True, fresh and i == 0
            )

    def _dres_top(self, st: ChunkActs, ch, mb: int) -> np.ndarray:
        """On the head chunk: the transform's backward (replicated: from the allreduced
        decoder input gradient, in tp_buf), leaving dL/d ln_f's output in tp_buf for
        GPT's ln_f backward (post-LN: dL/d the top layer's output, dres itself)."""
        if ch.head:
            w, g, k = self.w, self.g, self.k
            shape = st.mlm_act.shape
            dact = self.scratch("dmlm_act", *shape)
            dact.fill(0)
            k.layernorm_backward(
                dact, g["mlm.ln.weight"], g["mlm.ln.bias"], self._full(), st.mlm_act,
                w["mlm.ln.weight"], st.mlm_mean, st.mlm_rstd, self._fresh("mlm.ln.weight"),
            )  # fmt: skip
            dpre = self.scratch("dmlm_pre", *shape)
            k.gelu_backward(dpre, st.mlm_pre, dact, fresh=True)
            wn = "mlm.dense.weight"
            k.matmul_backward(
                self._full(), g[wn], g["mlm.dense.bias"], dpre, st.mlm_in, w[wn], True,
                self._fresh(wn),
            )  # fmt: skip
            if self.post:
                st.dres[...] = self._full()
                return st.dres
        return super()._dres_top(st, ch, mb)


class BertRuntime(Runtime):
    """The GPT runtime with BERT's shard and masked samples."""

    Shard = BertShard

    def _batch(self, mb: int):
        S = self.S
        g = (self.iteration * S.dp + self.dp_rank) * S.m * S.B + mb * S.B
        tokens, _ = super()._batch(mb)
        return mask_tokens(tokens, S.seed, g, S.cfg.vocab_size)
