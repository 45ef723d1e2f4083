"""The LoRA adapters a Decoder serves: the adapter table in its weights (wedlm_jax.lora.table)
and the names of its rows.

    plan = make_plan(config, engine, lora=LoraOptions(enable_lora=True, max_loras=4))
    decoder = Decoder(params, plan)            # the weights carry an empty table (row 0: base)
    adapters = Adapters(decoder)
    adapters.load("sql", "out/sql-adapter")    # a PEFT folder checked, written into a free row
    row = adapters.acquire("sql")              # a request's hold on its row (Request.adapter)
    adapters.release(row)                      # when the request ends
    adapters.unload("sql")                     # the row zeroed; refused while a request holds it

A row is written by one compiled program for every row (`lora_table.write_row`, the table
donated, compiled when the Decoder is made), so loading an adapter compiles nothing, and the
decode programs take the same shapes whatever the rows hold. Reading a folder (`read`) is host
work that may run on any thread; `install` / `unload` write the table and must run on the thread
that owns the device (between `generate` calls: nothing in flight sees a row change). A request
holds its row from submission to its finish, so no row in use is unloaded or reused.
"""

from __future__ import annotations

import dataclasses
import threading

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from decode.config import DecodeConfigError
from decode.engine.runtime.pages import ROOT
from decode.lora_options import check_name
from wedlm_jax.lora import table as lora_table
from wedlm_jax import model as model_lib
from wedlm_jax.lora.spec import LoraError, LoraSpec


class AdapterNotFound(DecodeConfigError):
    """A name that no loaded adapter has (the server's 404)."""


def with_table(params, static, mesh=None):
    """The Decoder's weights with an empty adapter table of `static`'s shape (max_loras + 1 rows,
    max_lora_rank), laid out as the weights are (stacked or one tree per layer; replicated over
    a mesh); row 0 written once, so `write_row` is compiled before any adapter loads."""
    c = static.config
    table = lora_table.empty_table(c, static.max_loras, static.max_lora_rank,
                                   jnp.dtype(static.dtype))
    if not static.stacked_layers:
        table = model_lib.unstack_layers(table, c.num_layers)
    if mesh is not None:
        table = jax.device_put(table, NamedSharding(mesh, P()))
    table = lora_table.write_row(table, jnp.int32(0), _zero(static))
    return lora_table.attach(params, table)


def with_table_shapes(params, static):
    """Abstract weights (ShapeDtypeStructs) with the adapter table's shapes beside them, laid out
    as `with_table` lays the table out (ahead-of-time compiles: decode/compile/aot.py)."""
    c = static.config
    table = lora_table.table_shapes(c, static.max_loras, static.max_lora_rank,
                                    jnp.dtype(static.dtype))
    return lora_table.attach(params, _laid_out(static, table))


def _zero(static):
    return _laid_out(static, lora_table.zero_rows(static.config, static.max_lora_rank))


def _laid_out(static, rows):
    return rows if static.stacked_layers else model_lib.unstack_layers(rows,
                                                                      static.config.num_layers)


def write(decoder, row: int, rows) -> None:
    """Row `row` of the Decoder's adapter table set to `rows` (`lora_table.adapter_rows`, host
    float32, layers stacked); the Decoder's weights are replaced (the old table donated)."""
    rest, table = lora_table.detach(decoder.params)
    table = lora_table.write_row(table, jnp.int32(row), _laid_out(decoder.static, rows))
    decoder.params = lora_table.attach(rest, table)


@dataclasses.dataclass
class Loaded:
    name: str
    path: str
    row: int
    spec: LoraSpec
    serial: int = 0         # which load this is (the row's content, for the prefix cache's root)
    holds: int = 0          # requests holding the row (submitted, not finished)


class Adapters:
    """The names of a Decoder's adapter rows, and the requests holding each (thread-safe)."""

    def __init__(self, decoder):
        st = decoder.static
        if not st.max_loras:
            raise DecodeConfigError("this Decoder has no LoRA adapter table (--enable-lora)",
                                    "enable_lora")
        self.decoder = decoder
        self.max_loras, self.max_rank = st.max_loras, st.max_lora_rank
        self._by_name: dict[str, Loaded] = {}
        self._loads = 0
        self._lock = threading.Lock()

    def loaded(self) -> list[Loaded]:
        with self._lock:
            return sorted(self._by_name.values(), key=lambda a: a.row)

    def read(self, path):
        """(LoraSpec, table rows) of a PEFT folder for this Decoder's model: a DecodeConfigError
        naming the option, the tensor or the rank that does not fit, before any device work."""
        from wedlm_jax.lora.peft import load_peft
        config = self.decoder.model_config
        try:
            spec, adapters = load_peft(path, config, self.max_rank)
            return spec, lora_table.adapter_rows(config, adapters, spec, self.max_rank)
        except LoraError as e:
            raise DecodeConfigError(str(e), e.field) from None
        except OSError as e:
            raise DecodeConfigError(f"{path}: cannot be read ({e.strerror or e})", "lora_path") \
                from None

    def install(self, name: str, path: str, spec: LoraSpec, rows) -> int:
        """Put an adapter `read` gave into a free row under `name` (the device's thread);
        returns the row. A DecodeConfigError when the name is taken or every row is."""
        check_name(name)
        with self._lock:
            if name in self._by_name:
                raise DecodeConfigError(f"the LoRA adapter {name!r} is already loaded",
                                        "lora_name")
            used = {a.row for a in self._by_name.values()}
            free = [r for r in range(1, self.max_loras + 1) if r not in used]
            if not free:
                raise DecodeConfigError(f"all {self.max_loras} adapter rows are taken "
                                        f"(--max-loras {self.max_loras}): unload one first",
                                        "lora_name")
            write(self.decoder, free[0], rows)
            self._loads += 1
            self._by_name[name] = Loaded(name, str(path), free[0], spec, self._loads)
            return free[0]

    def load(self, name: str, path) -> int:
        """`read` then `install` (the device's thread)."""
        return self.install(name, str(path), *self.read(path))

    def unload(self, name: str) -> None:
        """Zero `name`'s row and forget the name (the device's thread); refused while a request
        holds it (AdapterNotFound for an unknown name)."""
        with self._lock:
            got = self._by_name.get(name)
            if got is None:
                raise AdapterNotFound(f"the LoRA adapter {name!r} cannot be found", "lora_name")
            if got.holds:
                raise DecodeConfigError(f"the LoRA adapter {name!r} is in use by {got.holds} "
                                        "request(s); unload it once they finish", "lora_name")
            write(self.decoder, got.row, lora_table.zero_rows(self.decoder.model_config,
                                                               self.max_rank))
            del self._by_name[name]

    def prefix_root(self, row: int):
        """The root a prefix's pages computed under adapter `row` are cached under
        (decode.engine.runtime.pages): one per load, so a row loaded again with another adapter shares
        none of the pages its former adapter wrote; the base's (row 0) is pages.ROOT."""
        if not row:
            return ROOT
        with self._lock:
            got = next((a for a in self._by_name.values() if a.row == row), None)
        if got is None:
            raise DecodeConfigError(f"no LoRA adapter is loaded in row {row}", "model")
        return ("lora", got.serial)

    def acquire(self, name: str) -> int:
        """A request's hold on `name`'s row (returned); AdapterNotFound for an unknown name."""
        with self._lock:
            got = self._by_name.get(name)
            if got is None:
                raise AdapterNotFound(f"the model {name!r} does not exist", "model")
            got.holds += 1
            return got.row

    def release(self, row: int) -> None:
        """A request's hold on `row` given back."""
        with self._lock:
            for got in self._by_name.values():
                if got.row == row and got.holds:
                    got.holds -= 1
                    return
