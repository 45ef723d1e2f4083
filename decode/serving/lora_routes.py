"""wedlm-serve's LoRA adapters, as vLLM serves them (`--enable-lora`): a request's `model` names
the base or a loaded adapter (`model_of`; an unknown name is a 404 naming it, as vLLM answers;
without --enable-lora the server keeps its 400 naming the model it serves), GET /v1/models
lists the adapters beside the base (`parent`: the base's id), and POST /v1/load_lora_adapter
{"lora_name", "lora_path"} / POST /v1/unload_lora_adapter {"lora_name"} change them at run time.

A folder is read and checked off the event loop before any device work (a rank above
--max-lora-rank, an adapter for another base named by its tensor and both shapes, a PEFT option
this server does not apply: 400 naming it); its table row is written on the engine thread between
steps (decode.engine.runtime.adapters), so nothing in flight sees it change. An adapter in use by a
request is not unloaded (400 saying how many hold it).
"""

import asyncio

from decode.config import DecodeConfigError
from decode.engine.runtime.adapters import AdapterNotFound
from decode.serving.protocol import APIError, bad


def not_found(model, served=()) -> APIError:
    """vLLM's answer to a `model` this server does not serve (with or without LoRA), naming
    what it serves."""
    names = f" This server serves {', '.join(map(repr, served))}." if served else ""
    shown = model.encode("utf-8", "backslashreplace").decode() if isinstance(model, str) \
        else repr(model)                          # a lone surrogate is shown, not sent
    return APIError(404, f"The model `{shown}` does not exist.{names}", param="model",
                    type="NotFoundError", code="model_not_found")


def model_of(body: dict, cfg) -> str | None:
    """The adapter a request body's `model` names (None: the base model, or no model given);
    a 404 when it names neither the base nor a loaded adapter."""
    model = body.get("model")
    if model is None or model == cfg.model_name:
        return None
    if cfg.adapters is not None and isinstance(model, str) and any(
            a.name == model for a in cfg.adapters.loaded()):
        return model
    raise not_found(model, [cfg.model_name] + ([a.name for a in cfg.adapters.loaded()]
                                               if cfg.adapters is not None else []))


def model_cards(cfg, created: int) -> list:
    """/v1/models' entries: the base, then every loaded adapter (vLLM's fields)."""
    base = {"id": cfg.model_name, "object": "model", "created": created, "owned_by": "wedlm-jax",
            "root": cfg.model_name, "parent": None, "max_model_len": cfg.capacity}
    loaded = cfg.adapters.loaded() if cfg.adapters is not None else []
    return [base] + [dict(base, id=a.name, root=a.path, parent=cfg.model_name) for a in loaded]


def _name(body: dict, cfg) -> str:
    if cfg.adapters is None:
        raise bad(None, "this server serves no LoRA adapters (start it with --enable-lora)",
                  "lora_disabled")
    name = body.get("lora_name")
    if not isinstance(name, str) or not name:
        raise bad("lora_name", "'lora_name' (a string) is required", "missing_required_parameter")
    return name


async def _on_engine(engine, fn):
    """fn() run on the engine thread between steps; its result (or its exception, raised)."""
    loop = asyncio.get_running_loop()
    fut = loop.create_future()

    def settle(result):
        if not fut.done():
            (fut.set_exception if isinstance(result, BaseException) else fut.set_result)(result)
    try:
        engine.call(fn, lambda r: loop.call_soon_threadsafe(settle, r))
    except RuntimeError as e:
        raise APIError(503, str(e), type="server_error", code="unavailable") from None
    return await fut


async def load_adapter(engine, cfg, body: dict) -> str:
    """POST /v1/load_lora_adapter: the folder read and checked here, its row written on the
    engine thread. Returns vLLM's success text."""
    name, path = _name(body, cfg), body.get("lora_path")
    if not isinstance(path, str) or not path:
        raise bad("lora_path", "'lora_path' (a PEFT folder on the server) is required",
                  "missing_required_parameter")
    if name == cfg.model_name:
        raise bad("lora_name", f"'lora_name' {name!r} is the base model's name")
    registry = cfg.adapters
    try:
        if any(a.name == name for a in registry.loaded()):
            raise DecodeConfigError(f"The lora adapter '{name}' has already been loaded.",
                                    "lora_name")
        spec, rows = await asyncio.to_thread(registry.read, path)
        await _on_engine(engine, lambda: registry.install(name, path, spec, rows))
    except DecodeConfigError as e:
        raise bad("lora_path" if e.field not in ("lora_name",) else "lora_name", str(e)) from None
    return f"Success: LoRA adapter '{name}' added successfully."


async def unload_adapter(engine, cfg, body: dict) -> str:
    """POST /v1/unload_lora_adapter: the row zeroed on the engine thread (refused while a request
    holds it). Returns vLLM's success text."""
    name = _name(body, cfg)
    try:
        await _on_engine(engine, lambda: cfg.adapters.unload(name))
    except AdapterNotFound:
        raise APIError(404, f"The lora adapter '{name}' cannot be found.", param="lora_name",
                       type="NotFoundError", code="lora_not_found") from None
    except DecodeConfigError as e:
        raise bad("lora_name", str(e)) from None
    return f"Success: LoRA adapter '{name}' removed successfully."
