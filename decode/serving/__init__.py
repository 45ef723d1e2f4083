"""wedlm-serve, the OpenAI-compatible server: the command (serve), the HTTP routes (app), the
completion endpoints (completions), request parsing (protocol), prompt scoring (scoring) and the
thread that owns the device (worker), on the engine's Batcher."""
