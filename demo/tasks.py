"""The demo's generated tasks: text a small model can master and that can be checked
exactly, centred on what shows WeDLM's parallelism.

Every task draws one document (training) or one problem (held out) from a seed, so the training
split (seeds 0, 1, ...) and the held-out split (HELDOUT_SEED + i) never share a draw, and a
held-out prompt that the training generator happens to produce as well is skipped by the builder.

  counting  "Count by k from a to b:" then the numbers, each written with the end value ("x/b"):
            strides 1-25, starts up to ~10^4, also down ("Count down by k from a to b:"), one per
            line ("..., one per line:"); a document ends at "b/b".
  arith     "Q: a + b" / "Q: a - b" (1-4 digit operands, a >= b for -), then worked columns from
            the right: each line restates what is left of the operands and the carry (borrow),
            adds one column and the result so far, so every step reads only the line above it;
            the last line is "a op b = c".
  lists     "copy [..] -> [..]" and "sort [..] -> [..]" (3-8 numbers under 100).
  records   a small table ("name | age | city" rows) rendered as JSON lines; the names are
            composed from syllables (recipe 2; recipe 1, the shipped weights', drew 26 names).

Each `*_problem(rng)` returns (prompt, target): the document is prompt + target, and the held-out
eval item asks for the target given the prompt.
"""

from __future__ import annotations

import json
import random

# ----------------------------------------------------------------------------------- counting

COUNT_FORMATS = ("by", "by", "by", "from", "down", "lines")


def _start(rng: random.Random) -> int:
    """Starts spread over magnitudes: 1-99, 100-999, 1000-9999 (a third each, roughly)."""
    return rng.randint(1, 10 ** rng.randint(2, 4) - 1)


def counting_parts(rng: random.Random) -> tuple[str, list[str], str]:
    """(header, items, separator): the document is header + sep.join(items). Every item carries
    the end value ("15/30"), so the stop is an equality in plain sight ("30/30"), not a
    comparison with a number far back in the header."""
    header, xs, sep = _count(rng)
    return header, [f"{x}/{xs[-1]}" for x in xs], sep


def _count(rng: random.Random) -> tuple[str, list[str], str]:
    fmt = rng.choice(COUNT_FORMATS)
    k = rng.randint(1, 25) if rng.random() < 0.85 else rng.randint(1, 5)
    a = _start(rng)
    digits = len(str(a + 25 * 40))
    n = rng.randint(6, max(8, min(40, 220 // (2 * digits + 3))))
    if fmt == "down":
        a = max(a, k * n)
        nums = [a - k * i for i in range(n)]
        return f"Count down by {k} from {nums[0]} to {nums[-1]}:\n", [str(x) for x in nums], ", "
    nums = [a + k * i for i in range(n)]
    if fmt == "from":
        nums = list(range(a, a + n))
        return f"Count from {nums[0]} to {nums[-1]}:\n", [str(x) for x in nums], ", "
    if fmt == "lines":
        return (f"Count by {k} from {nums[0]} to {nums[-1]}, one per line:\n",
                [str(x) for x in nums], "\n")
    return f"Count by {k} from {nums[0]} to {nums[-1]}:\n", [str(x) for x in nums], ", "


def counting_problem(rng: random.Random) -> tuple[str, str]:
    """The header and the first few numbers as the prompt; the rest of the count as the target."""
    header, xs, sep = counting_parts(rng)
    shown = 3 if len(xs) > 10 else 2
    return header + sep.join(xs[:shown]) + sep, sep.join(xs[shown:])


def counting_doc(rng: random.Random) -> str:
    header, xs, sep = counting_parts(rng)
    return header + sep.join(xs)


# ----------------------------------------------------------------------------------- arithmetic

def add_work(a: int, b: int) -> list[str]:
    """One line per column from the right: "rest_a+rest_b cC: x+y+C=s -> so_far"."""
    lines, ra, rb, carry, so_far = [], str(a), str(b), 0, ""
    while ra or rb or carry:
        x, y = int(ra[-1]) if ra else 0, int(rb[-1]) if rb else 0
        s = x + y + carry
        so_far = str(s % 10) + so_far
        lines.append(f"{ra or 0}+{rb or 0} c{carry}: {x}+{y}+{carry}={s} -> {so_far}")
        ra, rb, carry = ra[:-1], rb[:-1], s // 10
    return lines


def sub_work(a: int, b: int) -> list[str]:
    """a >= b. One line per column from the right: "rest_a-rest_b bB: x-y-B=d bB' -> so_far"."""
    lines, ra, rb, borrow, so_far = [], str(a), str(b), 0, ""
    while ra:
        x, y = int(ra[-1]), int(rb[-1]) if rb else 0
        d = x - y - borrow
        nb = int(d < 0)
        so_far = str(d + 10 * nb) + so_far
        lines.append(f"{ra}-{rb or 0} b{borrow}: {x}-{y}-{borrow}={d + 10 * nb} b{nb} -> {so_far}")
        ra, rb, borrow = ra[:-1], rb[:-1], nb
    return lines


def _operand(rng: random.Random, lo_digits: int, hi_digits: int) -> int:
    d = rng.randint(lo_digits, hi_digits)
    return rng.randint(10 ** (d - 1) if d > 1 else 0, 10 ** d - 1)


def arith_problem(rng: random.Random, lo_digits: int = 1, hi_digits: int = 4) -> tuple[str, str, str]:
    """(question line, worked lines + final line, answer) for + or -."""
    op = rng.choice("+-")
    a, b = _operand(rng, lo_digits, hi_digits), _operand(rng, lo_digits, hi_digits)
    if op == "-" and b > a:
        a, b = b, a
    ans = a + b if op == "+" else a - b
    work = add_work(a, b) if op == "+" else sub_work(a, b)
    return f"Q: {a} {op} {b}\n", "\n".join(work) + f"\n{a} {op} {b} = {ans}\n", str(ans)


def arith_doc(rng: random.Random, skip=frozenset()) -> str:
    parts = []
    for _ in range(rng.randint(1, 2)):
        q, work, _ = arith_problem(rng)
        if q not in skip:
            parts.append(q + work)
    return "\n".join(parts)


# ----------------------------------------------------------------------------------- lists

def list_problem(rng: random.Random) -> tuple[str, str]:
    xs = [rng.randint(0, 99) for _ in range(rng.randint(3, 8))]
    op = rng.choice(("copy", "sort"))
    out = sorted(xs) if op == "sort" else xs
    # the prompt stops before the space: the tokenizer reads " [" as one token, so a prompt ending
    # in a lone space would ask for a token split that training never showed
    return f"{op} {xs} ->", f" {out}"


def lists_doc(rng: random.Random, skip=frozenset()) -> str:
    lines = []
    for _ in range(rng.randint(3, 8)):
        p, a = list_problem(rng)
        if p not in skip:
            lines.append(p + a)
    return "\n".join(lines)


# ----------------------------------------------------------------------------------- records

# The data recipe: 1 drew every name from the 26 NAMES, which a tokenizer trained on the data can
# learn as one token each (then a model may output one name for every row instead of copying);
# 2 composes names of 2 or 3 SYLLABLES (18,252 of them), so a name is several tokens the model must
# copy one by one. Only the names differ; a model folder's training.json records its recipe
# (recipe_of: none recorded is 1, the recipe of the shipped weights).
RECIPE = 2
RECIPES = (1, 2)
NAMES = ("Alice Bob Carol Dan Eve Frank Grace Heidi Ivan Judy Ken Laura Mike Nina Oscar Peggy "
         "Quinn Rita Sam Tina Uma Victor Wendy Xena Yuri Zoe").split()
SYLLABLES = ("ka lo mi ra to ne su vi da re li no sa ma ri ta be ko lu ze fi go ha ju "
             "pe wo").split()
CITIES = "Paris Rome Oslo Lima Cairo Tokyo Delhi Berlin Madrid Vienna Dublin Quito".split()
COLORS = "red blue green black white yellow orange purple".split()
FIELDS = {"name": lambda r: r.choice(NAMES), "age": lambda r: r.randint(18, 90),
          "city": lambda r: r.choice(CITIES), "color": lambda r: r.choice(COLORS),
          "id": lambda r: r.randint(100, 999), "score": lambda r: r.randint(0, 100)}


def composed_name(rng: random.Random) -> str:
    """2 or 3 SYLLABLES, capitalised ("Kalomi"): recipe 2's names."""
    return "".join(rng.choice(SYLLABLES) for _ in range(rng.randint(2, 3))).capitalize()


def all_composed_names() -> set[str]:
    """Every name composed_name can draw (distinct strings)."""
    two = {a + b for a in SYLLABLES for b in SYLLABLES}
    return {n.capitalize() for n in two | {ab + c for ab in two for c in SYLLABLES}}


def check_recipe(recipe: int) -> int:
    if recipe not in RECIPES:
        raise ValueError(f"unknown data recipe {recipe!r}; recipes: {', '.join(map(str, RECIPES))}")
    return recipe


def recipe_of(settings: dict) -> int:
    """The recipe a data build's settings (stats.json's, training.json's data.settings) record;
    a build from before recipes were recorded is recipe 1."""
    return check_recipe(settings.get("recipe", 1))


def record_fields(recipe: int = RECIPE) -> dict:
    """FIELDS with the recipe's name draw (the same keys in the same order: the same draws
    otherwise)."""
    name = FIELDS["name"] if check_recipe(recipe) == 1 else composed_name
    return dict(FIELDS, name=name)


def records_problem(rng: random.Random, recipe: int = RECIPE) -> tuple[str, str]:
    fields = record_fields(recipe)
    cols = ["name"] + rng.sample([f for f in fields if f != "name"], rng.randint(1, 3))
    rows = [{c: fields[c](rng) for c in cols} for _ in range(rng.randint(2, 5))]
    table = "\n".join([" | ".join(cols)] + [" | ".join(str(r[c]) for c in cols) for r in rows])
    return f"Table:\n{table}\nJSON lines:\n", "\n".join(json.dumps(r) for r in rows)


def records_doc(rng: random.Random, skip=frozenset(), recipe: int = RECIPE) -> str:
    p, a = records_problem(rng, recipe)
    return "" if p in skip else p + a


# ----------------------------------------------------------------------------------- held out

def heldout_items(seed0: int, n_count: int, n_arith: int, n_lists: int, n_records: int,
                  recipe: int = RECIPE) -> list[dict]:
    """Held-out problems with exact targets, each from its own seed (seed0 + i): counting (prompt =
    header + first numbers), arithmetic with 2-4 digit operands, lists, records (their names
    drawn the recipe's way)."""
    items = []
    for i in range(n_count):
        p, t = counting_problem(random.Random(seed0 + i))
        items.append({"kind": "counting", "prompt": p, "target": t, "seed": seed0 + i})
    for i in range(n_arith):
        q, work, ans = arith_problem(random.Random(seed0 + i), lo_digits=2)
        items.append({"kind": "arith", "prompt": q, "target": work, "answer": ans, "seed": seed0 + i})
    for i in range(n_lists):
        p, a = list_problem(random.Random(seed0 + i))
        items.append({"kind": "lists", "prompt": p, "target": a, "answer": a, "seed": seed0 + i})
    for i in range(n_records):
        p, a = records_problem(random.Random(seed0 + i), recipe)
        items.append({"kind": "records", "prompt": p, "target": a, "answer": a, "seed": seed0 + i})
    return items
