"""Opening a checkpoint folder to decode with: the one way every door does it (wedlm-decode, the
batch job, wedlm-serve, the demo).

    ckpt = OpenCheckpoint.open(folder, placement, method="streaming", mask_token_id=None)
    ckpt = OpenCheckpoint.from_args(args)   # a door: its --checkpoint, --method, ... flags
    ...                                  # config.json and the tokenizer are read and checked;
                                         # check the requests against them here
    config, params, mesh = ckpt.load()   # then the weights, on the placement's mesh and dtype

Two phases so that a bad request or setting is refused before any weight is read. What decoding
needs from the folder is decided here once: the model config (config.json), the tokenizer, the
[MASK] id (`mask_token_id`) and the default stop ids.
"""

from __future__ import annotations

import dataclasses
import os
import sys

from decode.config import DecodeConfigError, Placement, mask_id_for
from decode.text import TextTokenizer, load_tokenizer
from wedlm_jax.config import ModelConfig


def check_quantized_folder(folder: str, placement: Placement, group: int) -> None:
    """A folder written quantized (`wedlm-convert hf-to-orbax --quantize`) decodes under its own
    scheme: DecodeConfigError (field quantize) naming both when the placement asks for another
    (`group`: the placement's group size, `Placement.check_model`)."""
    from wedlm_jax.quantize_scheme import QuantizeError
    from wedlm_jax.checkpoints.quantized import check_matches
    try:
        check_matches(folder, placement.quantize, group)
    except QuantizeError as e:
        raise DecodeConfigError(str(e), e.field) from None


def _stderr(prog: str):
    return lambda message: print(f"{prog}: {message}", file=sys.stderr)


@dataclasses.dataclass(frozen=True)
class OpenCheckpoint:
    """A checkpoint folder whose config.json and tokenizer are read and checked (no weights yet)."""
    folder: str
    config: ModelConfig            # config.json
    tokenizer: TextTokenizer
    mask_token_id: int             # what the Decoder gets (mask_id_for; AR: 0, never read)
    default_stop_ids: tuple        # eos and friends (decode.text); () with default_stops=False
    placement: Placement

    @classmethod
    def open(cls, folder: str, placement: Placement | None = None, *, method: str = "streaming",
             mask_token_id: int | None = None, default_stops: bool = True,
             prog: str = "wedlm-decode", tokenizer: TextTokenizer | None = None) -> "OpenCheckpoint":
        """Read and check the tokenizer (or take the one read already: a door that checks its
        prompts with it reads it first, `load_tokenizer(folder)`), then config.json (against the
        placement: dtype, mesh; a quantized folder's scheme against its quantize).
        DecodeConfigError / ConfigError / FileNotFoundError name what is wrong."""
        from wedlm_jax.checkpoints import read_config
        placement = placement or Placement()
        tokenizer = tokenizer or load_tokenizer(folder)
        config = read_config(folder)
        check_quantized_folder(folder, placement, placement.check_model(config))
        mask = mask_id_for(config, mask_token_id, method, tokenizer=tokenizer,
                           source=os.path.join(folder, "config.json"), name="--mask-token-id",
                           announce=_stderr(prog))
        stops = tuple(tokenizer.default_stop_ids(config.eos_token_id)) if default_stops else ()
        return cls(folder, config, tokenizer, mask, stops, placement)

    @classmethod
    def from_args(cls, args, placement: Placement | None = None, **kw) -> "OpenCheckpoint":
        """`open` with a door's flags: --checkpoint, --method, --mask-token-id, --no-default-stops
        (`add_decoding_arguments`), on `placement` (default: the flags' own); `kw`: `open`'s prog
        and tokenizer."""
        if kw.get("tokenizer") is None and getattr(args, "chat_template", None):
            kw["tokenizer"] = load_tokenizer(args.checkpoint, args.chat_template)
        return cls.open(args.checkpoint, placement or Placement.from_args(args), method=args.method,
                        mask_token_id=args.mask_token_id, default_stops=not args.no_default_stops,
                        **kw)

    def load(self):
        """(ModelConfig, params, mesh): the weights in the placement's dtype on its mesh (None: the
        default device), their layers stacked or one tree each as the platform's decode programs
        take them (`decode.engine.planning.layouts.layers_stacked`); the config carries the [MASK] id decided
        here, so `generate(params, config, ...)` and a Decoder need no other argument for it.
        With the placement's `quantize`, the projections come quantized (wedlm_jax.quantize), the
        float copy dropped; a quantized folder's as stored (wedlm_jax.checkpoints.quantized)."""
        import jax

        from decode.engine.planning.layouts import layers_stacked
        from wedlm_jax import grouped_matmul
        from wedlm_jax.checkpoints import checkpoint_kind, load_checkpoint
        from wedlm_jax.quantize import is_quantized, quantize_params
        from wedlm_jax.quantize_scheme import resolve_group
        mesh = self.placement.make_mesh()
        quiet = {} if checkpoint_kind(self.folder) == "orbax" else {"progress": False}
        platform = (mesh.devices.flat[0] if mesh is not None else jax.local_devices()[0]).platform
        kernel = grouped_matmul.for_plan(
            platform, resolve_group(self.placement.quantize, self.placement.quantize_group),
            1 if mesh is None else mesh.devices.size) == grouped_matmul.PALLAS
        # the layers as the decode programs take them (one tree each on GPU, and on TPU for a
        # grouped kernel), loaded that way
        config, params = load_checkpoint(self.folder, mesh=mesh, dtype=self.placement.dtype,
                                         stacked_layers=layers_stacked(platform, kernel), **quiet)
        config = config.replace(mask_token_id=self.mask_token_id)
        if not is_quantized(params):
            params = quantize_params(params, self.placement.quantize,
                                     self.placement.quantize_group, free=True)
        return config, params, mesh
