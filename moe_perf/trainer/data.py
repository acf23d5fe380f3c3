"""Training tokens: seeded synthetic batches, or windows of a tokenized corpus.

Every step has one global batch of `global_batch` sequences of S+1 tokens (inputs and shifted
labels), identical on every rank, split into this rank's micro-batches by the batch layout of
MeshDims (common/mesh.py: data-parallel rank r runs micro-batch m on rows
[(m*dp + r)*mb, (m*dp + r + 1)*mb), the order forced balance numbers tokens in).

Also the corpus build command (local text + local tokenizer.json, no downloads):
    python -m moe_perf.trainer.data build --tokenizer-file tok.json --text a.txt b.jsonl --out DIR
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

from moe_perf.common.corpus import FORMAT, META_FILE, TOKENS_FILE, check_corpus, read_meta
from moe_perf.common.mesh import MeshDims

EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "<｜end▁of▁sentence｜>")


class SyntheticTokens:
    """Uniform random tokens from torch.Generator(seed, step): the same on every rank."""

    def __init__(self, vocab_size: int, seed: int):
        self.vocab_size, self.seed = vocab_size, seed

    def global_batch(self, step: int, batch: int, seq: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        return torch.randint(0, self.vocab_size, (batch, seq + 1), generator=g)


class CorpusTokens:
    """Consecutive windows of S+1 tokens (stride S) from tokens.bin, wrapping around."""

    def __init__(self, directory: str | Path, vocab_size: int):
        meta = read_meta(directory)
        if meta["vocab_size"] > vocab_size:
            raise ValueError(
                f"corpus {directory} has vocab_size {meta['vocab_size']} > "
                f"model.vocab_size {vocab_size}: wrong tokenizer for this model"
            )
        self.tokens = np.memmap(Path(directory) / TOKENS_FILE, dtype=np.uint32, mode="r")

    def global_batch(self, step: int, batch: int, seq: int) -> torch.Tensor:
        n = len(self.tokens)
        if n < seq + 1:
            raise ValueError(f"corpus has {n} tokens, fewer than sequence_length+1 = {seq + 1}")
        span = n - seq  # number of valid window starts
        rows = [(((step * batch + r) * seq) % span) for r in range(batch)]
        out = np.stack([self.tokens[s : s + seq + 1] for s in rows]).astype(np.int64)
        return torch.from_numpy(out)


def make_source(data_cfg, model_cfg, seed: int):
    if data_cfg.corpus is None:
        return SyntheticTokens(model_cfg.vocab_size, seed)
    d = check_corpus(data_cfg.root, data_cfg.corpus, model_cfg.tokenizer)
    return CorpusTokens(d, model_cfg.vocab_size)


def local_microbatches(
    source, step: int, *, global_batch: int, micro_batch: int, seq: int, dp: int, dp_rank: int
):
    """[(inputs_BS, labels_BS)] of this data-parallel rank for one step (m-major order)."""
    rows = source.global_batch(step, global_batch, seq)
    dims = MeshDims(world=dp)  # the batch layout depends on dp alone
    out = []
    for m in range(dims.microbatches(global_batch, micro_batch)):
        start = dims.first_row(m, dp_rank, micro_batch)
        chunk = rows[start : start + micro_batch]
        out.append((chunk[:, :-1].contiguous(), chunk[:, 1:].contiguous()))
    return out


# --------------------------------------------------------------------------------------------
# Corpus build


def _documents(path: Path):
    """A .jsonl file gives one document per line ("text" field); any other file is one."""
    if path.suffix == ".jsonl":
        with path.open(encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    yield json.loads(line)["text"]
    else:
        yield path.read_text(encoding="utf-8")


def build_corpus(
    tokenizer_file: str | Path,
    texts: list[str | Path],
    out: str | Path,
    eos_token: str | None = None,
    batch_docs: int = 256,
) -> dict:
    try:
        from tokenizers import Tokenizer
    except ImportError as e:
        raise SystemExit(
            "the corpus build needs the `tokenizers` package: pip install 'moe_perf[corpus]'"
        ) from e
    tok = Tokenizer.from_file(str(tokenizer_file))
    names = [eos_token] if eos_token else list(EOS_CANDIDATES)
    eos_id = next((tok.token_to_id(t) for t in names if tok.token_to_id(t) is not None), None)
    if eos_id is None:
        raise SystemExit(
            f"no end-of-text token among {names} in {tokenizer_file}: pass --eos-token"
        )
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    num_tokens = 0
    tmp = out / (TOKENS_FILE + ".tmp")
    with tmp.open("wb") as f:
        for path in map(Path, texts):
            docs = list(_documents(path))
            for i in range(0, len(docs), batch_docs):
                for enc in tok.encode_batch(docs[i : i + batch_docs], add_special_tokens=False):
                    ids = np.asarray(enc.ids + [eos_id], dtype=np.uint32)
                    f.write(ids.tobytes())
                    num_tokens += len(ids)
    tmp.replace(out / TOKENS_FILE)
    meta = {
        "format": FORMAT,
        "dtype": "uint32",
        "num_tokens": num_tokens,
        "vocab_size": tok.get_vocab_size(),
        "eos_id": eos_id,
        "tokenizer": out.name,
        "tokenizer_file": str(Path(tokenizer_file).resolve()),
        "sources": [str(Path(t).resolve()) for t in texts],
    }
    (out / META_FILE).write_text(json.dumps(meta, indent=1) + "\n")
    return meta


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m moe_perf.trainer.data")
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="tokenize local text files into a corpus directory")
    b.add_argument("--tokenizer-file", required=True, help="a local tokenizer.json")
    b.add_argument(
        "--text",
        required=True,
        nargs="+",
        help=".txt (one document each) or .jsonl (one {'text': ...} per line)",
    )
    b.add_argument(
        "--out", required=True, help="<data.root>/<data.corpus>/toktxt/<model.tokenizer>"
    )
    b.add_argument("--eos-token", default=None)
    args = p.parse_args(argv)
    meta = build_corpus(args.tokenizer_file, args.text, args.out, args.eos_token)
    print(f"wrote {meta['num_tokens']} tokens to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
