"""Where a tokenized corpus lives, and the check that it is there (pure Python).

Layout: `<root>/<corpus>/toktxt/<tokenizer>/`, e.g. workspace/datasets/dclm-baseline/toktxt/qwen3/,
holding
  tokens.bin   the token ids of every document end to end, each followed by the EOS id (uint32)
  meta.json    {"format": "moe_perf.toktxt/1", "dtype": "uint32", "num_tokens": N,
                "vocab_size": V, "eos_id": id, "tokenizer": name, "sources": [...]}
The runner checks before launching; the trainer reads the same directory. Built from local text
files and a local tokenizer.json (no downloads) by `python -m moe_perf.trainer.data build`.
"""

from __future__ import annotations

import json
from pathlib import Path

FORMAT = "moe_perf.toktxt/1"
TOKENS_FILE = "tokens.bin"
META_FILE = "meta.json"


class CorpusError(FileNotFoundError):
    """The corpus asked for by `data.corpus` is missing; the message says how to build it."""


def corpus_dir(root: str | Path, corpus: str, tokenizer: str) -> Path:
    return Path(root) / corpus / "toktxt" / tokenizer


def build_command(path: str | Path) -> str:
    return (
        f"python -m moe_perf.trainer.data build --tokenizer-file <tokenizer.json> "
        f"--text <text files> --out {path}"
    )


def check_corpus(root: str | Path, corpus: str, tokenizer: str) -> Path:
    """The corpus directory; CorpusError naming `data.corpus` and the build command if absent
    or unreadable."""
    path = corpus_dir(root, corpus, tokenizer)
    how = f"Build it with `{build_command(path)}`, or set data.corpus=null for synthetic tokens"
    meta_path, tokens_path = path / META_FILE, path / TOKENS_FILE
    if not meta_path.is_file() or not tokens_path.is_file():
        raise CorpusError(
            f"data.corpus={corpus}: no tokenized corpus at {path} (tokenizer {tokenizer}). {how}"
        )
    try:
        meta = json.loads(meta_path.read_text())
        ok = (
            meta.get("format") == FORMAT
            and meta.get("dtype") == "uint32"
            and tokens_path.stat().st_size == 4 * int(meta["num_tokens"])
        )
    except (OSError, ValueError, KeyError, TypeError):
        ok = False
    if not ok:
        raise CorpusError(
            f"data.corpus={corpus}: {path} is not a complete {FORMAT} corpus (meta.json and "
            f"tokens.bin disagree or are unreadable). Rebuild it with `{build_command(path)}`"
        )
    return path


def read_meta(path: str | Path) -> dict:
    return json.loads((Path(path) / META_FILE).read_text())
