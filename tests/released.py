"""Tiny stand-ins for the released WeDLM checkpoints (tencent/WeDLM-8B*, WeDLM-7B*), built offline:
the released config.json fields at tiny sizes, random weights, and a Qwen-style byte-level BPE
tokenizer whose special tokens sit at the Qwen ids (<|endoftext|> 151643, <|im_start|> 151644,
<|im_end|> 151645), so the vocabulary has the released size and holds the [MASK] id 151665."""

from __future__ import annotations

import json
import os

QWEN_SPECIALS = {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645}
RELEASED_VOCAB = 151936
CORPUS = ["the weather in Paris is sunny and warm", "get_weather city unit celsius", "hello world",
          "You are a helpful assistant.", "count with me: one, two, three, four"] * 4

# A Qwen-style chat template (written for these tests): system turn, tool schemas shown with
# `tojson`, tool calls and tool responses, a `namespace`, `{% break %}` / `{% continue %}`,
# `raise_exception` for unknown roles.
QWEN_STYLE_TEMPLATE = """{%- set ns = namespace(last_user=-1) %}
{%- for m in messages | reverse %}
    {%- if m.role == 'user' %}
        {%- set ns.last_user = (messages | length) - loop.index %}
        {%- break %}
    {%- endif %}
{%- endfor %}
{%- if tools %}
<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}{% else %}You are a helpful assistant.{% endif %}

# Tools
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools><|im_end|>
{% elif messages[0].role == 'system' %}
<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for m in messages %}
    {%- if m.role == 'system' %}
        {%- if not loop.first %}{{ raise_exception('a system message must come first') }}{% endif %}
        {%- continue %}
    {%- endif %}
    {%- if m.role == 'user' %}
<|im_start|>user
{{ m.content }}{% if loop.index0 == ns.last_user %} [last query]{% endif %}<|im_end|>
    {% elif m.role == 'assistant' %}
<|im_start|>assistant
{{ m.content }}
        {%- for call in m.tool_calls or [] %}
<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>
        {%- endfor %}<|im_end|>
    {% elif m.role == 'tool' %}
<|im_start|>user
<tool_response>
{{ m.content }}
</tool_response><|im_end|>
    {% else %}
{{ raise_exception('unknown role: ' ~ m.role) }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
<|im_start|>assistant
{% endif %}"""

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather <now> & later, in °C",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]
MESSAGES = [
    {"role": "system", "content": "You are terse. Answer in café style & use <tools>."},
    {"role": "user", "content": "Weather in Zürich? <b>now</b>"},
    {"role": "assistant", "content": "",
     "tool_calls": [{"type": "function", "function": {"name": "get_weather",
                                                       "arguments": {"city": "Zürich", "unit": "°C <&>"}}}]},
    {"role": "tool", "content": "{\"temp\": 21}"},
    {"role": "assistant", "content": "21 °C & sunny."},
]


def qwen_style_tokenizer(folder, chat_template: str | None = QWEN_STYLE_TEMPLATE,
                         eos_token: str = "<|im_end|>") -> str:
    """Write tokenizer.json (byte-level BPE, Qwen special tokens at the Qwen ids) and
    tokenizer_config.json into `folder`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    os.makedirs(folder, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=320, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    d = json.loads(tok.to_str())
    # ids in the model vocabulary are kept as written (sparse), unlike appended added tokens
    d["model"]["vocab"].update(QWEN_SPECIALS)
    d["added_tokens"] = [{"id": i, "content": s, "single_word": False, "lstrip": False,
                          "rstrip": False, "normalized": False, "special": True}
                         for s, i in QWEN_SPECIALS.items()]
    with open(os.path.join(folder, "tokenizer.json"), "w") as f:
        json.dump(d, f, ensure_ascii=False)
    cfg = {"eos_token": eos_token, "pad_token": "<|endoftext|>", "bos_token": None,
           "unk_token": None, "model_max_length": 16384}
    if chat_template is not None:
        cfg["chat_template"] = chat_template
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump(cfg, f, ensure_ascii=False)
    return os.fspath(folder)


def released_config(kind: str, vocab_size: int = RELEASED_VOCAB, qk_norm="released") -> dict:
    """config.json of the released WeDLM-8B (`kind='8b'`, Qwen3-based) or WeDLM-7B (`'7b'`,
    Qwen2.5-based) with the released conventions and tiny sizes. `qk_norm`: 'released' (the value
    the release states), None (field absent) or a bool."""
    d = {
        "architectures": ["WeDLMForCausalLM"],
        "auto_map": {"AutoConfig": "configuration_wedlm.WeDLMConfig",
                     "AutoModel": "modeling_wedlm.WeDLMModel",
                     "AutoModelForCausalLM": "modeling_wedlm.WeDLMForCausalLM"},
        "model_type": "wedlm",
        "attention_dropout": 0.0,
        "bos_token_id": 151643,
        "eos_token_id": 151643,
        "pad_token_id": 151643,
        "mask_token_id": None,
        "hidden_act": "silu",
        "hidden_size": 32,
        "initializer_range": 0.02,
        "intermediate_size": 64,
        "max_position_embeddings": 16384,
        "max_window_layers": 2,
        "num_attention_heads": 4,
        "num_hidden_layers": 2,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 1000000.0,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": vocab_size,
    }
    if kind == "8b":
        d.update(attention_bias=False, head_dim=8, qk_norm=True)
    elif kind == "7b":
        d.update(attention_bias=True, qk_norm=False)
    else:
        raise ValueError(kind)
    if qk_norm is None:
        del d["qk_norm"]
    elif qk_norm != "released":
        d["qk_norm"] = bool(qk_norm)
    return d


def model_config_of(kind: str, vocab_size: int = RELEASED_VOCAB):
    """This project's ModelConfig of the same architecture (to draw and write the weights)."""
    from wedlm_jax.config import ModelConfig
    return ModelConfig(model_type="wedlm", vocab_size=vocab_size, hidden_size=32, intermediate_size=64,
                       num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, rope_theta=1e6,
                       max_position_embeddings=16384, qkv_bias=kind == "7b", qk_norm=kind == "8b",
                       eos_token_id=151643)


def write_released(folder, kind: str, seed: int = 0, **config_kw) -> str:
    """A Hugging Face folder as the release ships it: safetensors (bf16, random weights), the
    released config.json (written by hand, not by this project's writer), the tokenizer."""
    from tests.synthetic import random_params
    from wedlm_jax.checkpoints import save_hf_checkpoint
    params = random_params(model_config_of(kind), seed=seed, head_scale=20.0)
    path = save_hf_checkpoint(model_config_of(kind), params, folder, dtype="bf16", progress=False)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(released_config(kind, **config_kw), f, indent=2)
    qwen_style_tokenizer(path)
    return path


def set_config(folder, **fields) -> None:
    """Edit fields of `folder/config.json` (a value None deletes the field)."""
    path = os.path.join(folder, "config.json")
    with open(path) as f:
        d = json.load(f)
    for k, v in fields.items():
        if v is None:
            d.pop(k, None)
        else:
            d[k] = v
    with open(path, "w") as f:
        json.dump(d, f, indent=2)
