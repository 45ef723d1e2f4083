"""The training data: JSONL -> tokens -> packed rows -> a Grain pipeline of global batches.

Line formats (one JSON object per line, the format may differ between lines):
    {"text": "..."}                                  pretraining: every token maskable / a target
    {"prompt": "...", "response": "..."}             SFT: only response tokens maskable / targets
    {"messages": [{"role": ..., "content": ...}]}    SFT: only assistant tokens maskable / targets
                                                     (optional "tools": the tool schemas the template shows)

SFT records are rendered with the tokenizer folder's chat template (`wedlm_jax.tokenizer`: the same
files and Jinja environment as decoding and transformers' `apply_chat_template`)
(prompt/response become a user and an assistant turn); without a template a prompt/response pair is
plain concatenation and `messages` is an error. Tokenization uses the folder's `tokenizer.json`.

Everything is read, validated and tokenized up front (`load_documents`), so bad data stops the run
before anything compiles; a malformed line raises `DataError` with `file:line` and the reason, or is
skipped and counted with `skip_bad_lines`. Documents (shuffled with the seed) are packed greedily
into rows of `seq_len` tokens with segment ids (1, 2, ... per document, 0 = padding); a document
longer than a row is cut into row-sized pieces.

The pipeline (`make_pipeline`) is a Grain MapDataset: rows shuffled with the seed and repeated
(reshuffled each epoch). Global example index `g` is row `g` of that stream; the global batch of
step `s` holds `g = s*B .. s*B+B-1` in order, whatever the number of hosts: each JAX process reads
the rows of each global batch that its devices hold under the batch sharding (`rows_of_process`;
with the usual layout process `p` of `P` reads rows `p*B/P .. (p+1)*B/P - 1`, the split
`grain.sharding.ShardByJaxProcess` makes), which `to_global` turns into one global array with
`jax.make_array_from_process_local_data`. The
iterator's Grain state (`get_state` / `set_state`) is saved with each checkpoint for exact resume.

At scale (`data.packed_dir`): `python -m train.data.pretokenize` streams JSONL and Parquet through the
same record parser (`iter_records`) and packer (`pack_rows`, documents in input order, no document
shuffle) into ArrayRecord shards plus a meta.json; `open_packed` serves those rows (or a weighted
mixture of several folders) to the same `make_pipeline` (same row shuffle, global index mapping,
per-process rows and resume state). `read_packed_meta` checks the folder before anything compiles.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Sequence

import grain
import numpy as np

from wedlm_jax import tokenizer as tokenizer_lib
from wedlm_jax.tokenizer import MASK_TOKEN_CANDIDATES, find_mask_token, mask_token_rule



class DataError(ValueError):
    """Bad training data (missing file, malformed line, unusable tokenizer)."""


# ---------------------------------------------------------------------------------- tokenizer

# One tokenizer module for training and decoding (wedlm_jax/tokenizer.py): the same files, special
# tokens and chat-template environment, so an SFT prompt and a decode prompt of the same messages
# are the same ids.
TokenizerInfo = tokenizer_lib.Tokenizer


def load_tokenizer(folder: str) -> TokenizerInfo:
    """The `tokenizer.json` (and, when present, `tokenizer_config.json`, `chat_template.jinja`,
    `special_tokens_map.json`) of a checkpoint folder."""
    return tokenizer_lib.load_tokenizer(
        folder, error=DataError, hint=" (set data.tokenizer to a folder holding one)")


def resolve_mask_token_id(config, info: TokenizerInfo) -> int:
    """The [MASK] id to train with (`config`: the model config with objective.mask_token_id already
    applied): the rule decoding shares (`wedlm_jax.tokenizer.mask_token_rule`), or a DataError when
    it finds none."""
    mask, _ = mask_token_rule(config, info, os.path.join(info.folder, "config.json"),
                              "objective.mask_token_id")
    if mask is None:
        found = find_mask_token(info)
        where = (f"its mask token id {found} is outside the model vocabulary [0, {config.vocab_size})"
                 if found is not None else
                 f"the tokenizer has no mask token (looked for {', '.join(MASK_TOKEN_CANDIDATES)})")
        raise DataError(
            f"{info.folder}: {where} and no mask_token_id is given; set objective.mask_token_id "
            f"(e.g. the first id past the tokenizer's {info.vocab_size} tokens, if the model's "
            f"vocab_size {config.vocab_size} leaves room)")
    return mask


def _render_template(info: TokenizerInfo, messages, add_generation_prompt: bool, tools=None) -> str:
    return info.render_chat(messages, add_generation_prompt=add_generation_prompt, tools=tools)


def _chat_spans(info: TokenizerInfo, messages, tools=None) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character spans of its assistant turns."""
    full = _render_template(info, messages, False, tools)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = _render_template(info, messages[:i], True, tools)
        upto = _render_template(info, messages[:i + 1], False, tools)
        if not (upto.startswith(before) and full.startswith(upto)):
            raise ValueError("the chat template does not render the conversation incrementally "
                             "(earlier turns change when later ones are added); cannot locate the "
                             "assistant tokens")
        spans.append((len(before), len(upto)))
    return full, spans


def _encode_with_spans(info: TokenizerInfo, text: str, spans) -> tuple[np.ndarray, np.ndarray]:
    enc = info.tokenizer.encode(text, add_special_tokens=False)
    ids = np.asarray(enc.ids, np.int32)
    starts = np.asarray([o[0] for o in enc.offsets], np.int64)
    ends = np.asarray([o[1] for o in enc.offsets], np.int64)
    trained = np.zeros(len(ids), bool)
    for a, b in spans:
        trained |= (ends > a) & (starts < b) & (starts >= a)
    return ids, trained


# ------------------------------------------------------------------------------------ records

def _check_str(obj, key):
    v = obj.get(key)
    if not isinstance(v, str):
        raise ValueError(f"field {key!r} must be a string, got {type(v).__name__}")
    return v


def tokenize_record(obj, info: TokenizerInfo, append_eos: bool = True):
    """(token ids int32[n], trained bool[n]) of one parsed JSONL object; ValueError with the reason
    when the object is not one of the three formats."""
    if not isinstance(obj, dict):
        raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
    if "text" in obj:
        text = _check_str(obj, "text")
        if not text:
            raise ValueError("field 'text' is empty")
        ids = info.tokenizer.encode(text, add_special_tokens=False).ids
        if append_eos and info.eos_token_id is not None:
            ids = ids + [info.eos_token_id]
        ids = np.asarray(ids, np.int32)
        return ids, np.ones(len(ids), bool)
    if "prompt" in obj or "response" in obj:
        prompt, response = _check_str(obj, "prompt"), _check_str(obj, "response")
        if not response:
            raise ValueError("field 'response' is empty")
        if info.chat_template:
            return tokenize_record({"messages": [{"role": "user", "content": prompt},
                                                 {"role": "assistant", "content": response}]}, info)
        eos = info.eos_token if append_eos and info.eos_token else ""
        text = prompt + response + eos
        return _encode_with_spans(info, text, [(len(prompt), len(text))])
    if "messages" in obj:
        msgs = obj["messages"]
        if not isinstance(msgs, list) or not msgs:
            raise ValueError("field 'messages' must be a non-empty list")
        for j, m in enumerate(msgs):
            content_ok = isinstance(m.get("content"), str) if isinstance(m, dict) else False
            if isinstance(m, dict) and m.get("tool_calls") and m.get("content") is None:
                content_ok = True  # an assistant turn that only calls tools
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not content_ok:
                raise ValueError(f"messages[{j}] must be an object with string 'role' and 'content'")
        tools = obj.get("tools")
        if tools is not None and not isinstance(tools, list):
            raise ValueError(f"field 'tools' must be a list, got {type(tools).__name__}")
        if not any(m["role"] == "assistant" for m in msgs):
            raise ValueError("'messages' has no assistant turn (nothing to train on)")
        if not info.chat_template:
            raise ValueError(f"'messages' needs a chat template, and {info.folder}/"
                             f"tokenizer_config.json has none")
        text, spans = _chat_spans(info, msgs, tools)
        return _encode_with_spans(info, text, spans)
    raise ValueError(f"no 'text', 'prompt'/'response' or 'messages' field (keys: "
                     f"{', '.join(sorted(obj)) or 'none'})")


@dataclasses.dataclass(frozen=True)
class Documents:
    tokens: list  # of int32 arrays
    trained: list  # of bool arrays
    skipped: list  # "file:line: reason" of skipped lines
    num_lines: int


def check_files(files: Sequence[str]) -> None:
    missing = [f for f in files if not os.path.isfile(f)]
    if missing:
        raise DataError(f"data.train_files: {len(missing)} file(s) do not exist: "
                        f"{', '.join(missing)}")


def parse_record(obj, info: TokenizerInfo, *, vocab_size: int,
                 append_eos: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """(token ids int32[n], trained bool[n]) of one parsed record (a JSON object, a Parquet row);
    `ValueError` or `TypeError` with the reason when it is unusable."""
    ids, tr = tokenize_record(obj, info, append_eos)
    if len(ids) == 0:
        raise ValueError("tokenizes to nothing")
    if not tr.any():
        raise ValueError("has no trained token (the response tokenizes to nothing)")
    if ids.max() >= vocab_size:
        raise ValueError(f"token id {int(ids.max())} is outside the model "
                         f"vocabulary [0, {vocab_size})")
    return ids, tr


def parse_line(line: str, info: TokenizerInfo, *, vocab_size: int,
               append_eos: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """(token ids int32[n], trained bool[n]) of one non-blank JSONL line; `json.JSONDecodeError`,
    `ValueError` or `TypeError` with the reason when it is unusable."""
    obj = json.loads(line.rstrip("\r\n"))
    return parse_record(obj, info, vocab_size=vocab_size, append_eos=append_eos)


def iter_documents(files: Sequence[str], info: TokenizerInfo, *, vocab_size: int,
                   skip_bad_lines: bool = False, append_eos: bool = True,
                   skipped: list | None = None, counts: dict | None = None,
                   part: tuple[int, int] = (0, 1)):
    """Stream (token ids, trained) of every usable line of every file, in file order, one line in
    memory at a time. A bad line raises `DataError` with `file:line`, or (`skip_bad_lines`) is
    appended to `skipped`; `counts['lines']` counts the non-blank lines read. part=(k, n): only
    the lines whose index over all files is k mod n (one of n workers' share)."""
    def items():
        k, n = part
        index = -1
        for path in files:
            with open(path, "rb") as f:          # bytes, decoded line by line: a bad byte costs
                for lineno, raw in enumerate(f, 1):    # exactly its own line, named file:line
                    index += 1
                    if index % n == k:
                        yield f"{path}:{lineno}", raw
    yield from iter_records(items(), info, vocab_size=vocab_size, skip_bad_lines=skip_bad_lines,
                            append_eos=append_eos, skipped=skipped, counts=counts)


def iter_records(items, info: TokenizerInfo, *, vocab_size: int, skip_bad_lines: bool = False,
                 append_eos: bool = True, skipped: list | None = None,
                 counts: dict | None = None):
    """(token ids, trained) of every usable item of `items`, pairs (where, record): `record` is a
    JSONL line's bytes (decoded and parsed here) or an already parsed record (a dict: a Parquet
    row); `where` names it in errors (`file:line`, `file:row`). Blank lines are not counted."""
    skipped = [] if skipped is None else skipped
    counts = {} if counts is None else counts
    counts.setdefault("lines", 0)
    for where, raw in items:
        if isinstance(raw, bytes):
            if not raw.strip():
                continue
            counts["lines"] += 1                 # every non-blank line, bad ones included
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                _bad(skipped, skip_bad_lines, where,
                     f"not UTF-8 ({e.reason} at byte {e.start + 1} of the line)")
                continue
            if not line.strip():
                counts["lines"] -= 1             # blank once decoded (unicode white space)
                continue
            try:
                ids, tr = parse_line(line, info, vocab_size=vocab_size, append_eos=append_eos)
            except json.JSONDecodeError as e:
                _bad(skipped, skip_bad_lines, where, f"not valid JSON ({e.msg} at column {e.colno})")
                continue
            except (ValueError, TypeError) as e:
                _bad(skipped, skip_bad_lines, where, str(e))
                continue
        else:
            counts["lines"] += 1
            try:
                ids, tr = parse_record(raw, info, vocab_size=vocab_size, append_eos=append_eos)
            except (ValueError, TypeError) as e:
                _bad(skipped, skip_bad_lines, where, str(e))
                continue
        yield ids, tr


def load_documents(files: Sequence[str], info: TokenizerInfo, *, vocab_size: int,
                   skip_bad_lines: bool = False, append_eos: bool = True) -> Documents:
    """Read, validate and tokenize every line of every file."""
    check_files(files)
    toks, trained, skipped, counts = [], [], [], {}
    for ids, tr in iter_documents(files, info, vocab_size=vocab_size,
                                  skip_bad_lines=skip_bad_lines, append_eos=append_eos,
                                  skipped=skipped, counts=counts):
        toks.append(ids)
        trained.append(tr)
    if not toks:
        raise DataError(f"data.train_files: no usable line in {', '.join(files)}"
                        + (f" ({len(skipped)} skipped)" if skipped else ""))
    return Documents(toks, trained, skipped, counts["lines"])


SKIP_HINT = "(data.skip_bad_lines=true skips such lines)"   # the training config's way; a door
                                                            # with its own flag names that instead


def _bad(skipped: list, skip: bool, where: str, reason: str):
    if not skip:
        raise DataError(f"{where}: {reason} {SKIP_HINT}")
    skipped.append(f"{where}: {reason}")


# ------------------------------------------------------------------------------------ packing

def pack(docs: Documents, seq_len: int, seed: int, *, shuffle: bool = True) -> dict:
    """Greedy packing of the documents (in an order shuffled with `seed`; file order with
    `shuffle=False`) into rows of `seq_len`: a document goes into the current row when it fits,
    else starts a new row (the rest of the current row is padding); one longer than a row is cut
    into row-sized pieces, each its own document. Returns numpy arrays tokens int32 [N, L],
    segment_ids int32 [N, L] (1, 2, ... per document in the row, 0 = padding), maskable bool
    [N, L]."""
    order = (np.random.default_rng(seed).permutation(len(docs.tokens)) if shuffle
             else np.arange(len(docs.tokens)))
    rows_t, rows_s, rows_m = [], [], []
    for t, s, m in pack_rows(((docs.tokens[i], docs.trained[i]) for i in order), seq_len):
        rows_t.append(t), rows_s.append(s), rows_m.append(m)
    return {"tokens": np.stack(rows_t), "segment_ids": np.stack(rows_s),
            "maskable": np.stack(rows_m)}


def pack_rows(documents, seq_len: int):
    """The packing of `pack` as a stream: (tokens, trained) documents in -> (tokens int32[L],
    segment_ids int32[L], maskable bool[L]) rows out, holding one row's documents at a time."""
    cur_t, cur_m = [], []
    used = 0

    def row():
        t = np.zeros(seq_len, np.int32)
        s = np.zeros(seq_len, np.int32)
        m = np.zeros(seq_len, bool)
        pos = 0
        for k, (pt, pm) in enumerate(zip(cur_t, cur_m)):
            t[pos:pos + len(pt)] = pt
            s[pos:pos + len(pt)] = k + 1
            m[pos:pos + len(pt)] = pm
            pos += len(pt)
        return t, s, m

    for tokens, trained in documents:
        for a in range(0, len(tokens), seq_len):
            pt, pm = tokens[a:a + seq_len], trained[a:a + seq_len]
            if used + len(pt) > seq_len:
                yield row()
                cur_t, cur_m, used = [], [], 0
            cur_t.append(pt), cur_m.append(pm)
            used += len(pt)
    if cur_t:
        yield row()


# ----------------------------------------------------------------------------------- pipeline

def rows_of_process(sharding, global_batch: int, seq_len: int) -> tuple[int, int]:
    """(first row, row count) of the global batch that this process's devices hold under the batch
    `sharding` (what `jax.make_array_from_process_local_data` expects it to feed). With the usual
    layout, process p of P holds rows p*B/P .. (p+1)*B/P - 1 (`grain.sharding.ShardByJaxProcess`'s
    split); a mesh whose batch axes do not span the processes gives every process all rows."""
    idx = sharding.addressable_devices_indices_map((global_batch, seq_len))
    rows = set()
    for index in idx.values():
        rows.update(range(*index[0].indices(global_batch)))
    first, last = min(rows), max(rows) + 1
    if len(rows) != last - first:
        raise DataError(f"this process's devices hold non-contiguous rows of the global batch "
                        f"({sorted(rows)[:8]}...); order the mesh devices by process")
    return first, last - first


def row_stream(rows, seed: int) -> grain.MapDataset:
    """Global example index g -> the row dict {tokens, segment_ids, maskable} it reads: the rows
    shuffled with `seed` and repeated (reshuffled each epoch). `rows` may define its own stream
    (`rows.row_stream(seed)`: a weighted mixture of packed folders, train/data/mixture.py)."""
    if hasattr(rows, "row_stream"):
        return rows.row_stream(seed)
    order = grain.MapDataset.range(len(rows["tokens"])).shuffle(seed=seed).repeat()
    return order.map(lambda src: {"tokens": rows["tokens"][src],
                                  "segment_ids": rows["segment_ids"][src],
                                  "maskable": rows["maskable"][src]})


def make_pipeline(rows, global_batch: int, seed: int, *, first_row: int, local_rows: int,
                  num_batches: int | None = None) -> grain.IterDataset:
    """A Grain IterDataset of this process's part of each global batch: dicts of numpy arrays
    tokens/segment_ids/maskable [local_rows, L] and index int32 [local_rows] (global example
    index g; the source row is the g-th of the shuffled, repeated rows: `row_stream`)."""
    stream = row_stream(rows, seed)

    def row(k):
        step, j = divmod(int(k), local_rows)
        g = step * global_batch + first_row + j
        return {**stream[g], "index": np.int32(g)}

    total = (num_batches if num_batches is not None else (2 ** 31 - 1) // global_batch) * local_rows
    # Rows are read inline (no prefetch threads racing ahead): the Grain state stays exact.
    return grain.MapDataset.range(total).map(row).batch(local_rows, drop_remainder=True) \
        .to_iter_dataset(grain.ReadOptions(num_threads=0, prefetch_buffer_size=0))


def to_global(local: dict, shardings: dict, global_batch: int) -> dict:
    """This process's rows -> global jax arrays (one per key) with the given shardings."""
    import jax
    out = {}
    for k, v in local.items():
        shape = (global_batch,) + v.shape[1:]
        out[k] = jax.make_array_from_process_local_data(shardings[k], v, shape)
    return out


# ------------------------------------------------------------------------------- packed folders
#
# `python -m train.data.pretokenize` writes the packed rows of a corpus once (ArrayRecord shards plus a
# meta.json, train/data/arrayrecord.py); `data.packed_dir` serves them through the same pipeline. The
# readers, their checks and the older .npy layout are in train/data/packed.py; mixtures of several
# packed folders in train/data/mixture.py. The functions below are their entry points.

PACKED_META = "meta.json"
PACKED_ARRAYS = {"tokens": np.int32, "segment_ids": np.int32, "maskable": np.bool_}


def tokenizer_sha256(folder: str) -> str:
    import hashlib
    with open(os.path.join(folder, "tokenizer.json"), "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def read_packed_meta(folder: str, *, seq_len: int | None = None) -> dict:
    """meta.json of a packed folder (or the combined meta of a mixture file), checked against its
    shards and, when given, `seq_len`; DataError naming the file otherwise."""
    from train.data import packed
    return packed.read_packed_meta(folder, seq_len=seq_len)


def check_packed_tokenizer(meta: dict, folder: str, info: TokenizerInfo, vocab_size: int) -> None:
    """The packed rows were tokenized with this tokenizer, and fit the model's vocabulary."""
    from train.data import packed
    packed.check_packed_tokenizer(meta, folder, info, vocab_size)


def open_packed(folder: str, meta: dict | None = None):
    """A packed folder (or mixture) as the `rows` of `make_pipeline`: {'tokens', 'segment_ids',
    'maskable'}, each a lazily read sequence of rows."""
    from train.data import packed
    return packed.open_packed(folder, meta)
