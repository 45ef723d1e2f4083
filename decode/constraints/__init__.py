"""Structured outputs: a constraint (JSON schema, JSON object, regex, choice, grammar) compiled by
one of two backends: a token automaton whose tables the decoder reads on the device, or
llguidance's parser asked from the decode loop on the host (docs/algorithm.md §7,
docs/structured-outputs.md).

The words: a *structured output* is what the user asks for (response_format, structured_outputs,
guided_*); a *constraint* is its checked form (spec.Constraint); an *automaton* is its compiled
tables (automaton.Automaton); a *guide* is its state on the device (decode/engine/step/guide.py, Guide).

    spec.py       Constraint: what a request asks for, checked and hashed; the request fields of
                  every door (OpenAI response_format, vLLM structured_outputs / guided_*)
    vocab.py      the tokenizer's tokens as the bytes they decode to
    automaton.py  Constraint + vocabulary -> Automaton (numpy tables, cached by the hash): the
                  device backend
    keywords/     which JSON-schema keywords the device tables enforce exactly (the rest go to
                  the host or are refused by path); unsatisfiable schemas
    host.py       Constraint -> llguidance Grammar and its per-request Matcher: the host backend
    backends.py   the choice per request (auto, device, host) behind one interface
    table.py      the keywords each backend enforces, as a table generated from the code
"""
