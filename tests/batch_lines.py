"""What the batch-job tests share (tests/test_batch_job.py, tests/test_batch_job_multihost.py,
tests/test_kv_int8.py): the decoding settings of their runs, a JSONL input file written from
lines (dicts, or strings kept as they are), and a seeded file of varied requests (greedy and
sampled, stops, chat messages)."""

from __future__ import annotations

import json
import random

CAPACITY, WINDOW = 256, 4


def write_jsonl(path, lines):
    with open(path, "w") as f:
        for line in lines:
            f.write((line if isinstance(line, str) else json.dumps(line)) + "\n")
    return str(path)


def request_lines(n=24):
    rng = random.Random(4)
    words = "one two three four five the cat sat on mat hello world count with me".split()
    out = []
    for i in range(n):
        line = {"id": f"r{i}", "prompt": " ".join(rng.choice(words) for _ in range(rng.randint(1, 20))),
                "max_tokens": rng.randint(20, 60), "tau": rng.choice([0.0, 0.4, 1.0])}
        if i % 5 == 1:
            line.update(temperature=0.8, seed=i)
        if i % 7 == 3:
            line["stop"] = ["::", "ne"]
        if i % 9 == 4:
            line["messages"] = [{"role": "user", "content": line.pop("prompt")}]
        out.append(line)
    return out
