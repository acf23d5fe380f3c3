"""Training tokens: synthetic determinism, data-parallel shares, corpus build and its errors."""

from __future__ import annotations

import json

import pytest
import torch

from moe_perf.common.config import DataConfig, ModelConfig
from moe_perf.common.corpus import CorpusError, check_corpus, corpus_dir
from moe_perf.trainer.data import (
    CorpusTokens,
    SyntheticTokens,
    local_microbatches,
    main,
    make_source,
)


def test_synthetic_tokens_are_seeded_per_step():
    src = SyntheticTokens(100, seed=7)
    a, b = src.global_batch(3, 4, 16), SyntheticTokens(100, seed=7).global_batch(3, 4, 16)
    assert torch.equal(a, b) and a.shape == (4, 17) and int(a.max()) < 100
    assert not torch.equal(a, src.global_batch(4, 4, 16))
    assert not torch.equal(a, SyntheticTokens(100, seed=8).global_batch(3, 4, 16))


@pytest.mark.parametrize("dp,mb", [(1, 1), (2, 1), (2, 2), (4, 1)])
def test_dp_ranks_share_the_global_batch_micro_batch_major(dp, mb):
    src, G, S = SyntheticTokens(50, seed=0), 8, 6
    rows = src.global_batch(1, G, S)
    shares = [
        local_microbatches(src, 1, global_batch=G, micro_batch=mb, seq=S, dp=dp, dp_rank=r)
        for r in range(dp)
    ]
    n_micro = G // (dp * mb)
    assert all(len(s) == n_micro for s in shares)
    # Micro-batch m of rank r holds rows [(m*dp + r)*mb, ...): global token index order.
    stacked = torch.cat([shares[r][m][0] for m in range(n_micro) for r in range(dp)])
    assert torch.equal(stacked, rows[:, :-1])
    labels = torch.cat([shares[r][m][1] for m in range(n_micro) for r in range(dp)])
    assert torch.equal(labels, rows[:, 1:])


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers, trainers

    d = tmp_path_factory.mktemp("tok")
    tok = tokenizers.Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>", "<|endoftext|>"])
    text = [
        "the quick brown fox jumps over the lazy dog " * 20,
        "pack my box with five dozen liquor jugs " * 20,
    ]
    tok.train_from_iterator(text, trainer)
    path = d / "tokenizer.json"
    tok.save(str(path))
    return path


def test_corpus_build_and_read(tmp_path, tokenizer_file):
    (tmp_path / "a.txt").write_text("the quick brown fox " * 50)
    (tmp_path / "b.jsonl").write_text(
        "\n".join(json.dumps({"text": f"pack my box {i} with jugs"}) for i in range(30)) + "\n"
    )
    out = corpus_dir(tmp_path / "datasets", "mini", "toy")
    assert (
        main(
            [
                "build",
                "--tokenizer-file",
                str(tokenizer_file),
                "--text",
                str(tmp_path / "a.txt"),
                str(tmp_path / "b.jsonl"),
                "--out",
                str(out),
            ]
        )
        == 0
    )
    assert check_corpus(tmp_path / "datasets", "mini", "toy") == out
    meta = json.loads((out / "meta.json").read_text())
    assert meta["num_tokens"] > 100 and meta["vocab_size"] <= 120
    model = ModelConfig(
        name="t",
        vocab_size=128,
        hidden=8,
        num_layers=1,
        num_heads=1,
        num_kv_heads=1,
        head_dim=8,
        num_experts=2,
        top_k=1,
        expert_ffn=8,
        tokenizer="toy",
    )
    src = make_source(DataConfig(corpus="mini", root=str(tmp_path / "datasets")), model, 0)
    assert isinstance(src, CorpusTokens)
    batch = src.global_batch(2, 3, 16)
    assert batch.shape == (3, 17) and int(batch.max()) < meta["vocab_size"]
    assert torch.equal(batch, src.global_batch(2, 3, 16))
    # Every row is a real window of the stream, with the EOS id between documents.
    eos = meta["eos_id"]
    assert (torch.cat([src.global_batch(s, 3, 16) for s in range(10)]) == eos).any()

    # A model whose vocabulary is too small for this tokenizer is refused.
    with pytest.raises(ValueError, match="vocab_size"):
        make_source(
            DataConfig(corpus="mini", root=str(tmp_path / "datasets")),
            ModelConfig(**{**model.__dict__, "vocab_size": 16}),
            0,
        )


def test_missing_corpus_names_the_override_and_the_command(tmp_path):
    with pytest.raises(CorpusError) as e:
        check_corpus(tmp_path, "dclm-baseline", "qwen3")
    msg = str(e.value)
    assert "data.corpus=dclm-baseline" in msg
    assert "python -m moe_perf.trainer.data build" in msg
    assert str(tmp_path / "dclm-baseline" / "toktxt" / "qwen3") in msg


def test_truncated_corpus_is_refused(tmp_path):
    d = corpus_dir(tmp_path, "c", "t")
    d.mkdir(parents=True)
    (d / "meta.json").write_text(
        json.dumps({"format": "moe_perf.toktxt/1", "dtype": "uint32", "num_tokens": 10})
    )
    (d / "tokens.bin").write_bytes(b"\0" * 12)
    with pytest.raises(CorpusError, match="Rebuild"):
        check_corpus(tmp_path, "c", "t")
