"""Structured outputs: a constraint (JSON schema, JSON object, regex, choice) compiled into a token
automaton whose tables the decoder reads on the device (docs/algorithm.md §7).

The words: a *structured output* is what the user asks for (response_format, structured_outputs,
guided_*); a *constraint* is its checked form (spec.Constraint); an *automaton* is its compiled
tables (automaton.Automaton); a *guide* is its state on the device (decode/engine/guide.py, Guide).

    spec.py       Constraint: what a request asks for, checked and hashed; the request fields of
                  every door (OpenAI response_format, vLLM structured_outputs / guided_*)
    vocab.py      the tokenizer's tokens as the bytes they decode to
    automaton.py  Constraint + vocabulary -> Automaton (numpy tables, cached by the hash)
"""
