"""A Qwen-sized byte-level BPE tokenizer trained offline, for benchmarks that need a real
151,936-entry vocabulary (MaskBench's masks and compiles at Qwen3's size) without downloading one.

    python -m benchmarks.structured.bpe --out DIR [--vocab 151936] [--max-mb 200] [--roots DIR ...]

The text: the .py, .md, .rst and .txt files under the running interpreter's site-packages and
/usr/share/doc (or `--roots`), paths sorted, files above 2 MB skipped (generated tables), read
until `--max-mb` MB of UTF-8 (undecodable bytes replaced). The model: `tokenizers`' BPE trainer
with Qwen2's pre-tokenizer split (letters, single digits, punctuation runs, newlines) then the
GPT-2 byte-level mapping, the ByteLevel decoder, all 256 bytes in the alphabet, and the special
tokens <|endoftext|> (eos), <|im_start|>, <|im_end|>, <|mask|>; exactly `--vocab` entries in all
(a refusal, exit 2, when the text does not hold enough merges: give more with --max-mb).
Deterministic given the same files. Writes DIR/tokenizer.json, DIR/tokenizer_config.json
(eos_token, mask_token: `wedlm_jax.tokenizer.load_tokenizer(DIR)` reads it) and DIR/training.json
(files, bytes, seconds, vocabulary size).

Measured (2026-11-29, tokenizers 0.23.3, a 2-core machine shared with other jobs): the default
--max-mb 200 took 15,129 files, 210 MB, and reached exactly 151,936 entries; training 222 s
(3 min 44 s wall with the reading, 557 MB peak RSS). Same files, same tokenizer.json (checked
byte for byte at a smaller size).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import sysconfig
import time

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>")
EXTENSIONS = (".py", ".md", ".rst", ".txt")
MAX_FILE_BYTES = 2 << 20
# Qwen2's pre-tokenizer split (its tokenizer.json), before the byte-level mapping
QWEN_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+"
              r"[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


class BadInput(Exception):
    """One line on stderr, exit 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):   # one line, not the usage block
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        raise SystemExit(2)


def default_roots() -> list[str]:
    return [sysconfig.get_paths()["purelib"], "/usr/share/doc"]


def text_files(roots, max_bytes: int) -> tuple[list[str], int]:
    """(paths, total bytes): the sorted text files under `roots`, up to `max_bytes` in all."""
    found = []
    for root in roots:
        for dirpath, dirs, files in os.walk(root):
            dirs.sort()
            for f in files:
                if f.endswith(EXTENSIONS):
                    found.append(os.path.join(dirpath, f))
    chosen, total = [], 0
    for path in sorted(found):
        try:
            size = os.path.getsize(path)
        except OSError:
            continue
        if 0 < size <= MAX_FILE_BYTES and not os.path.islink(path):
            chosen.append(path)
            total += size
            if total >= max_bytes:
                break
    return chosen, total


def read_texts(paths, chunk: int = 1 << 20):
    """The files' text, about `chunk` characters at a time (undecodable bytes replaced)."""
    buf, n = [], 0
    for path in paths:
        try:
            with open(path, "rb") as f:
                text = f.read().decode("utf-8", errors="replace")
        except OSError:
            continue
        buf.append(text)
        n += len(text)
        if n >= chunk:
            yield from buf
            buf, n = [], 0
    yield from buf


def build(vocab_size: int):
    """An untrained byte-level BPE tokenizer and its trainer."""
    import tokenizers as tk
    tok = tk.Tokenizer(tk.models.BPE())
    tok.pre_tokenizer = tk.pre_tokenizers.Sequence([
        tk.pre_tokenizers.Split(tk.Regex(QWEN_SPLIT), behavior="isolated", invert=False),
        tk.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = tk.decoders.ByteLevel()
    tok.post_processor = tk.processors.ByteLevel(trim_offsets=False)
    trainer = tk.trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                     initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet(),
                                     min_frequency=2, show_progress=False)
    return tok, trainer


def train(out: str, vocab_size: int, roots, max_mb: float) -> dict:
    """Train, check the size and write DIR's files; returns the training record."""
    import tokenizers
    paths, total = text_files(roots, int(max_mb * (1 << 20)))
    if not paths:
        raise BadInput(f"no {', '.join(EXTENSIONS)} files under {', '.join(roots)}")
    tok, trainer = build(vocab_size)
    t0 = time.perf_counter()
    tok.train_from_iterator(read_texts(paths), trainer)
    seconds = time.perf_counter() - t0
    got = tok.get_vocab_size(with_added_tokens=True)
    record = {"vocab_size": got, "asked": vocab_size, "files": len(paths), "text_bytes": total,
              "train_s": round(seconds, 1), "roots": list(roots), "max_mb": max_mb,
              "special_tokens": list(SPECIAL_TOKENS), "tokenizers": tokenizers.__version__}
    if got != vocab_size:
        raise BadInput(f"the text ({total / 1e6:.0f} MB, {len(paths)} files) gave {got} entries, "
                       f"not {vocab_size}: give more text (--max-mb)")
    os.makedirs(out, exist_ok=True)
    tok.save(os.path.join(out, "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>",
              "pad_token": "<|endoftext|>", "mask_token": "<|mask|>", "bos_token": None,
              "unk_token": None, "add_bos_token": False}
    for name, doc in (("tokenizer_config.json", config), ("training.json", record)):
        with open(os.path.join(out, name), "w") as f:
            json.dump(doc, f, indent=1)
            f.write("\n")
    return record


def main(argv=None) -> int:
    ap = _Parser(prog="python -m benchmarks.structured.bpe")
    ap.add_argument("--out", required=True, help="the folder to write the tokenizer to")
    ap.add_argument("--vocab", type=int, default=151_936)
    ap.add_argument("--max-mb", type=float, default=200.0, help="MB of text to train on")
    ap.add_argument("--roots", nargs="+", default=None,
                    help="folders to read text from (default: site-packages, /usr/share/doc)")
    a = ap.parse_args(argv)
    roots = a.roots or default_roots()
    try:
        if a.vocab < 256 + len(SPECIAL_TOKENS):
            raise BadInput(f"--vocab must be at least {256 + len(SPECIAL_TOKENS)}, got {a.vocab}")
        missing = [r for r in roots if not os.path.isdir(r)]
        if missing:
            raise BadInput(f"{missing[0]}: no such folder (--roots)")
        if os.path.exists(a.out) and not os.path.isdir(a.out):
            raise BadInput(f"--out {a.out}: not a folder")
        record = train(a.out, a.vocab, roots, a.max_mb)
    except (BadInput, OSError) as e:
        print(f"{ap.prog}: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {a.out}/tokenizer.json: {record['vocab_size']} entries from "
          f"{record['text_bytes'] / 1e6:.0f} MB in {record['files']} files, trained in "
          f"{record['train_s']:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
