"""mlx-lm's model zoo, in miniature: tiny random-weight configs for the architectures
that mlx-lm ships in `mlx_lm/models/`, for parametrized tests over many models.

    ZOO[name] = (module under mlx_lm.models, ModelArgs dict)
    build(name) -> the model, random weights, parameters evaluated
    SKIPPED[module] = why that module file has no ZOO entry
    FACTS[name] = what a one-off scan of the built model found (see FACTS below)
    NOTES[name] = what is unusual about its forward pass or caches
    METAL_ONLY[name] = configs whose forward pass needs Metal (not in ZOO)
    MOE = the entries with MoE experts: float32 only on CPU

Every config is small (hidden size <= 128, 1-4 layers, vocab 256 except phi3small) so
that building one and running a 16-token prompt plus one decode step takes milliseconds
on a CPU. Architectures with interleaved layer types (sliding window, chunked, linear
attention / SSM, KV sharing, no-op layers) have enough layers that every type appears,
including a full-attention layer where the architecture has one. Sliding windows and
chunks are 8 tokens, so a 16-token prompt wraps them. All of ZOO ran on CPU: the
prompt and the decode step give finite logits of shape [1, N, vocab(name)] (phi3small:
-inf at the token ids it masks, see NOTES).

    model = build("gemma3_text")
    cache = mlx_lm.models.cache.make_prompt_cache(model)
    logits = model(mx.array([list(range(1, 17))]), cache=cache)
"""

import copy
import importlib

import mlx.core as mx

V = 256  # vocab size of every entry but phi3small (see vocab())

# The usual dense decoder: 64 wide, 4 query heads and 2 KV heads of 16, 2 layers.
DENSE = dict(
    hidden_size=64,
    num_hidden_layers=2,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    rms_norm_eps=1e-5,
    vocab_size=V,
)


def _dense(model_type, **kw):
    return {**DENSE, "model_type": model_type, **kw}


def _qwen3_5_text(model_type, **kw):
    """Qwen3.5's text config: gated-delta linear attention in layers 0-2, full attention in 3."""
    return dict(model_type=model_type, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=V, linear_num_value_heads=2, linear_num_key_heads=2,
                linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
                full_attention_interval=4, rms_norm_eps=1e-6, head_dim=16,
                rope_parameters={"rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                                 "rope_type": "default"},
                max_position_embeddings=1024, tie_word_embeddings=False, **kw)


# Multi-head latent attention (DeepSeek V2/V3 style) with a tiny MoE.
MLA = dict(
    kv_lora_rank=16,
    q_lora_rank=16,
    qk_rope_head_dim=8,
    qk_nope_head_dim=16,
    v_head_dim=16,
)
DEEPSEEK_MOE = dict(
    **DENSE,
    moe_intermediate_size=32,
    n_routed_experts=4,
    n_shared_experts=1,
    num_experts_per_tok=2,
    n_group=2,
    topk_group=1,
    first_k_dense_replace=1,
    **MLA,
)

ZOO = {
    "Klear": ("Klear", _dense(
        "Klear", attention_bias=False, mlp_only_layers=[0], num_experts=4, num_experts_per_tok=2,
        decoder_sparse_step=1, n_shared_experts=1, moe_intermediate_size=32, rope_theta=1000.0,
        max_position_embeddings=1024, norm_topk_prob=True)),
    # afm7: 2 ordinary layers, then 2 layers that reuse the last ordinary layer's KV
    "afm7": ("afm7", dict(
        model_type="afm7", vocab_size=V, hidden_dim=64, num_layers=4, num_kv_reuse_layers=2,
        num_heads=4, num_kv_heads=2)),
    # afmoe: sliding, full, sliding; layer 0 dense MLP, MoE after
    "afmoe": ("afmoe", dict(
        model_type="afmoe", vocab_size=V, hidden_size=64, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, intermediate_size=128, head_dim=16,
        rope_theta=1000.0, sliding_window=8,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, num_dense_layers=1)),
    "apertus": ("apertus", _dense(
        "apertus", mlp_bias=True, attention_bias=False, max_position_embeddings=1024,
        rope_theta=1000.0, post_norm=True, qk_norm=True, tie_word_embeddings=False)),
    # sliding window (8) in layer 0, full attention in layer 1
    "baichuan_m1": ("baichuan_m1", _dense(
        "baichuan_m1", rope_theta=1000.0, sliding_window=8, sliding_window_layers=[0],
        conv_window=2)),
    # layer_group_size 2: layer 0 linear attention, layer 1 global MLA
    "bailing_hybrid": ("bailing_hybrid", _dense(
        "bailing_hybrid", moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
        num_shared_experts=1, n_group=1, topk_group=1, first_k_dense_replace=1,
        layer_group_size=2, group_norm_size=1, rope_theta=1000.0, max_position_embeddings=1024,
        routed_scaling_factor=1.0, head_dim=16, kv_lora_rank=16, q_lora_rank=16,
        qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16)),
    "bailing_moe": ("bailing_moe", _dense(
        "bailing_moe", max_position_embeddings=1024, moe_intermediate_size=32, num_experts=4,
        num_shared_experts=1, norm_topk_prob=True, num_experts_per_tok=2, rope_theta=1000.0,
        first_k_dense_replace=1)),
    "bailing_moe_linear": ("bailing_moe_linear", _dense(
        "bailing_moe_linear", max_position_embeddings=1024, moe_intermediate_size=32,
        num_experts=4, num_shared_experts=1, norm_topk_prob=True, num_experts_per_tok=2,
        rope_theta=1000.0, first_k_dense_replace=0, layer_group_size=2, group_norm_size=1)),
    # layer_group_size 2: layer 0 KDA linear attention, layer 1 MLA
    "bailing_moe_v3": ("bailing_moe_v3", dict(
        model_type="bailing_hybrid", vocab_size=V, hidden_size=64, intermediate_size=128,
        moe_intermediate_size=32, moe_shared_expert_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_experts=4, num_experts_per_tok=2, num_shared_experts=1,
        first_k_dense_replace=1, n_group=1, topk_group=1, layer_group_size=2, head_dim=16,
        q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
        max_position_embeddings=1024)),
    "cohere": ("cohere", _dense("cohere", layer_norm_eps=1e-5)),
    # cohere2: sliding window in layers 0-2, full attention in layer 3
    "cohere2": ("cohere2", _dense(
        "cohere2", num_hidden_layers=4, head_dim=16, sliding_window=8, sliding_window_pattern=4,
        layer_norm_eps=1e-5)),
    "dbrx": ("dbrx", dict(
        model_type="dbrx", vocab_size=V, d_model=64, n_layers=2, n_heads=4,
        ffn_config={"ffn_hidden_size": 64, "moe_num_experts": 4, "moe_top_k": 2},
        attn_config={"kv_n_heads": 2, "clip_qkv": 8.0, "rope_theta": 10000.0})),
    "deepseek": ("deepseek", _dense(
        "deepseek", moe_intermediate_size=32, n_routed_experts=4, n_shared_experts=1,
        num_experts_per_tok=2, first_k_dense_replace=1)),
    "deepseek_v2": ("deepseek_v2", {**DEEPSEEK_MOE, "model_type": "deepseek_v2", "rope_scaling": {
        "type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024,
        "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}}),
    "deepseek_v3": ("deepseek_v3", {**DEEPSEEK_MOE, "model_type": "deepseek_v3"}),
    "deepseek_v32": ("deepseek_v32", {
        **DEEPSEEK_MOE, "model_type": "deepseek_v32", "index_n_heads": 2, "index_head_dim": 16,
        "index_topk": 4}),
    # deepseek_v41: layer 0 window only, layer 1 window + compressed KV (ratio 4) + indexer
    "deepseek_v41": ("deepseek_v41", dict(
        model_type="deepseek_v41", vocab_size=V, hidden_size=64, num_hidden_layers=2,
        num_attention_heads=4, head_dim=32, q_lora_rank=16, qk_rope_head_dim=8, o_groups=2,
        o_lora_rank=16, moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2,
        sliding_window=8, compress_ratios=[0, 4], kv_source_layer_ids=[1],
        index_source_layer_ids=[1], index_n_heads=2, index_head_dim=16, index_topk=4,
        candidate_topk_blocks=4, max_position_embeddings=4096, hc_mult=2, hc_sinkhorn_iters=3,
        rms_norm_eps=1e-6)),
    "dots1": ("dots1", _dense(
        "dots1", max_position_embeddings=None, first_k_dense_replace=1, moe_intermediate_size=32,
        n_routed_experts=4, n_shared_experts=1, norm_topk_prob=True, num_experts_per_tok=2,
        rope_theta=1000.0, routed_scaling_factor=1.0)),
    "ernie4_5": ("ernie4_5", _dense(
        "ernie4_5", max_position_embeddings=1024, head_dim=None, rope_theta=10000.0,
        use_bias=False, tie_word_embeddings=True)),
    "ernie4_5_moe": ("ernie4_5_moe", _dense(
        "ernie4_5_moe", max_position_embeddings=1024, rope_theta=1000.0, use_bias=False,
        tie_word_embeddings=False, moe_num_experts=4, moe_k=2, moe_intermediate_size=32,
        moe_layer_start_index=1)),
    "exaone": ("exaone", dict(
        model_type="exaone", hidden_size=64, num_layers=2, intermediate_size=128,
        num_attention_heads=4, num_key_value_heads=2, vocab_size=V, layer_norm_epsilon=1e-5,
        rope_theta=10000.0)),
    # exaone4: "LLGL" -> sliding, sliding, full, sliding
    "exaone4": ("exaone4", _dense(
        "exaone4", num_hidden_layers=4, max_position_embeddings=1024, rope_theta=10000.0,
        head_dim=16, tie_word_embeddings=False, rope_scaling=None, sliding_window=8,
        sliding_window_pattern="LLGL")),
    "exaone_moe": ("exaone_moe", _dense(
        "exaone_moe", moe_intermediate_size=32, head_dim=16, num_experts=4,
        num_experts_per_tok=2, num_shared_experts=1, n_group=1, topk_group=1,
        routed_scaling_factor=1.0, norm_topk_prob=True, sliding_window=8,
        max_position_embeddings=1024, rope_theta=1000.0,
        layer_types=["sliding_attention", "full_attention"], is_moe_layer=[False, True],
        tie_word_embeddings=False)),
    # falcon_h1: every layer runs attention and a Mamba2 mixer side by side
    "falcon_h1": ("falcon_h1", dict(
        model_type="falcon_h1", vocab_size=V, hidden_size=64, num_hidden_layers=2,
        intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16, mamba_d_state=16, mamba_n_groups=1,
        mamba_d_conv=4, mamba_expand=1, max_position_embeddings=1024)),
    # gear: conv mixer, sliding window and full attention layers
    "gear": ("gear", _dense(
        "gear", num_hidden_layers=3, head_dim=16, sliding_window=8,
        layer_types=["conv_mixer", "sliding_attention", "full_attention"])),
    "gemma": ("gemma", _dense("gemma", head_dim=16)),
    "gemma2": ("gemma2", _dense("gemma2", head_dim=16, query_pre_attn_scalar=16)),
    # gemma3: multimodal wrapper around gemma3_text, built text-only
    "gemma3": ("gemma3", dict(model_type="gemma3", vocab_size=V, text_config=dict(
        model_type="gemma3_text", hidden_size=64, num_hidden_layers=3, intermediate_size=128,
        num_attention_heads=4, num_key_value_heads=1, head_dim=16, query_pre_attn_scalar=16,
        rms_norm_eps=1e-6, sliding_window=8, sliding_window_pattern=3))),
    # gemma3_text: sliding, sliding, full
    "gemma3_text": ("gemma3_text", _dense(
        "gemma3_text", num_hidden_layers=3, num_key_value_heads=1, head_dim=16,
        query_pre_attn_scalar=16, sliding_window=8, sliding_window_pattern=3)),
    # gemma3n: layers 2-3 reuse the KV of the last non-shared layer of their type
    "gemma3n": ("gemma3n", dict(model_type="gemma3n", text_config=dict(
        model_type="gemma3n_text", hidden_size=64, num_hidden_layers=4, intermediate_size=128,
        num_attention_heads=4, head_dim=16, rms_norm_eps=1e-6, vocab_size=V,
        num_key_value_heads=2, num_kv_shared_layers=2, vocab_size_per_layer_input=V,
        sliding_window=8, max_position_embeddings=1024, rope_local_base_freq=10000.0,
        rope_theta=1000000.0, final_logit_softcapping=30.0,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        activation_sparsity_pattern=[0.95, 0.0, 0.0, 0.0], hidden_size_per_layer_input=16,
        altup_num_inputs=2, altup_coef_clip=120.0, altup_correct_scale=True, altup_active_idx=0,
        laurel_rank=8))),
    # gemma4: multimodal wrapper around gemma4_text, built text-only
    "gemma4": ("gemma4", dict(model_type="gemma4", vocab_size=V, text_config=dict(
        model_type="gemma4_text", hidden_size=64, num_hidden_layers=4, intermediate_size=128,
        num_attention_heads=4, num_key_value_heads=1, num_global_key_value_heads=1, head_dim=16,
        global_head_dim=32, rms_norm_eps=1e-6, vocab_size=V, vocab_size_per_layer_input=V,
        num_kv_shared_layers=2, hidden_size_per_layer_input=16, sliding_window=8,
        sliding_window_pattern=2, final_logit_softcapping=30.0,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        rope_parameters={
            "full_attention": {"partial_rotary_factor": 0.25, "rope_theta": 1000000.0},
            "sliding_attention": {"rope_theta": 10000.0}}))),
    # gemma4_text: layers 2-3 share the KV of layers 0-1 (same types)
    "gemma4_text": ("gemma4_text", _dense(
        "gemma4_text", num_hidden_layers=4, num_key_value_heads=1, num_global_key_value_heads=1,
        head_dim=16, global_head_dim=32, rms_norm_eps=1e-6, vocab_size_per_layer_input=V,
        num_kv_shared_layers=2, hidden_size_per_layer_input=16, sliding_window=8,
        sliding_window_pattern=2, final_logit_softcapping=30.0,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        rope_parameters={
            "full_attention": {"partial_rotary_factor": 0.25, "rope_theta": 1000000.0},
            "sliding_attention": {"rope_theta": 10000.0}})),
    "glm": ("glm", _dense("glm", head_dim=16)),
    "glm4": ("glm4", _dense(
        "glm4", attention_bias=False, head_dim=16, partial_rotary_factor=0.5, rope_theta=1000.0)),
    "glm4_moe": ("glm4_moe", _dense(
        "glm4_moe", max_position_embeddings=1024, moe_intermediate_size=32, norm_topk_prob=True,
        n_group=1, head_dim=16, topk_group=1, n_shared_experts=1, n_routed_experts=4,
        routed_scaling_factor=1.0, num_experts_per_tok=2, first_k_dense_replace=1,
        rope_theta=1000.0, rope_scaling=None, use_qk_norm=True, tie_word_embeddings=False,
        attention_bias=False, partial_rotary_factor=0.5)),
    "glm4_moe_lite": ("glm4_moe_lite", {
        **DEEPSEEK_MOE, "model_type": "glm4_moe_lite", "n_group": 1, "topk_group": 1,
        "topk_method": "noaux_tc", "scoring_func": "sigmoid", "norm_topk_prob": True,
        "routed_scaling_factor": 1.0, "moe_layer_freq": 1, "max_position_embeddings": 1024,
        "rope_theta": 1000.0, "rope_scaling": None, "attention_bias": False,
        "partial_rotary_factor": 1.0, "tie_word_embeddings": False}),
    "glm_moe_dsa": ("glm_moe_dsa", {
        **DEEPSEEK_MOE, "model_type": "glm_moe_dsa", "index_head_dim": 16, "index_n_heads": 2,
        "index_topk": 4, "n_group": 1, "topk_group": 1, "topk_method": "noaux_tc",
        "scoring_func": "sigmoid", "norm_topk_prob": True, "routed_scaling_factor": 1.0,
        "moe_layer_freq": 1, "max_position_embeddings": 1024, "attention_bias": False,
        "rope_parameters": {"rope_theta": 1000.0, "rope_type": "default"}}),
    "gpt2": ("gpt2", dict(
        model_type="gpt2", n_ctx=1024, n_embd=64, n_head=4, n_layer=2, n_positions=1024,
        layer_norm_epsilon=1e-5, vocab_size=V)),
    "gpt_bigcode": ("gpt_bigcode", dict(
        model_type="gpt_bigcode", n_embd=64, n_layer=2, n_inner=128, n_head=4, n_positions=1024,
        layer_norm_epsilon=1e-5, vocab_size=V)),
    "gpt_neox": ("gpt_neox", dict(
        model_type="gpt_neox", max_position_embeddings=1024, hidden_size=64, num_attention_heads=4,
        num_hidden_layers=2, layer_norm_eps=1e-5, vocab_size=V, rotary_emb_base=10000,
        rotary_pct=0.25)),
    # gpt_oss: sliding window in layer 0, full attention in layer 1, attention sinks
    "gpt_oss": ("gpt_oss", _dense(
        "gpt_oss", head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
        rope_theta=10000.0, layer_types=["sliding_attention", "full_attention"])),
    "gptj": ("gptj", dict(
        model_type="gptj", n_embd=64, vocab_size=V, n_positions=1024, n_head=4, rotary_dim=8,
        n_layer=2)),
    "granite": ("granite", _dense(
        "granite", logits_scaling=1.0, attention_multiplier=0.25, embedding_multiplier=1.0,
        residual_multiplier=1.0, max_position_embeddings=1024, attention_bias=False,
        mlp_bias=False, rope_theta=1000.0)),
    "granitemoe": ("granitemoe", _dense(
        "granitemoe", logits_scaling=1.0, attention_multiplier=0.25, embedding_multiplier=1.0,
        residual_multiplier=1.0, max_position_embeddings=1024, attention_bias=False,
        rope_theta=1000.0, num_local_experts=4, num_experts_per_tok=2)),
    # granitemoehybrid: Mamba2 layer, then attention
    "granitemoehybrid": ("granitemoehybrid", _dense(
        "granitemoehybrid", max_position_embeddings=1024, attention_bias=False,
        embedding_multiplier=1.0, attention_multiplier=0.25, logits_scaling=1.0,
        residual_multiplier=1.0, num_local_experts=4, num_experts_per_tok=2,
        shared_intermediate_size=64, mamba_n_heads=4, mamba_d_head=16, mamba_proj_bias=False,
        mamba_d_state=16, mamba_d_conv=4, mamba_n_groups=1, mamba_conv_bias=False,
        layer_types=["mamba", "attention"], rope_theta=1000.0)),
    "helium": ("helium", _dense(
        "helium", attention_bias=False, head_dim=16, max_position_embeddings=1024,
        mlp_bias=False, rope_theta=1000.0, tie_word_embeddings=False)),
    # hunyuan: cross-layer attention (layer 1 reuses layer 0's K/V projections)
    "hunyuan": ("hunyuan", _dense(
        "hunyuan", attention_bias=False, moe_topk=2, num_experts=2, num_shared_expert=1,
        use_mixed_mlp_moe=True, use_qk_norm=True, rope_theta=1000.0,
        rope_scaling={"alpha": 1000.0, "factor": 1.0, "type": "dynamic"}, use_cla=True,
        cla_share_factor=2)),
    "hunyuan_v1_dense": ("hunyuan_v1_dense", _dense(
        "hunyuan_v1_dense", rope_theta=1000.0, use_qk_norm=True, max_position_embeddings=1024,
        rope_scaling={"alpha": 1000.0, "factor": 1.0, "type": "dynamic"})),
    "internlm2": ("internlm2", _dense("internlm2")),
    "internlm3": ("internlm3", _dense("internlm3")),
    # iquestloopcoder: the stack runs twice; the second loop mixes global and windowed attention
    "iquestloopcoder": ("iquestloopcoder", _dense(
        "iquestloopcoder", head_dim=16, rope_theta=10000.0, tie_word_embeddings=False,
        loop_num=2, loop_window_size=8)),
    # jamba: Mamba in layer 0, attention in layer 1 (MoE in layer 1)
    "jamba": ("jamba", _dense(
        "jamba", attn_layer_offset=1, attn_layer_period=2, expert_layer_offset=1,
        expert_layer_period=2, mamba_d_conv=4, mamba_d_state=16, mamba_expand=2,
        num_experts=4, num_experts_per_tok=2, max_position_embeddings=1024)),
    # kimi_k25: multimodal wrapper around DeepSeek V3 (MLA), built text-only
    "kimi_k25": ("kimi_k25", dict(model_type="kimi_k25", text_config={
        **DEEPSEEK_MOE, "model_type": "deepseek_v3"})),
    # kimi_k3: KDA linear attention in layer 0 (kda_layers is 1-based), MLA in layer 1
    "kimi_k3": ("kimi_k3", dict(model_type="kimi_k3", text_config=dict(
        model_type="kimi_linear", vocab_size=V, hidden_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, intermediate_size=128,
        linear_attn_config={"num_heads": 4, "head_dim": 16, "short_conv_kernel_size": 4,
                            "kda_layers": [1]},
        kv_lora_rank=16, q_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8,
        v_head_dim=16, num_experts=4, num_experts_per_token=2, num_shared_experts=1,
        moe_intermediate_size=32, first_k_dense_replace=1))),
    # kimi_linear: KDA linear attention in layer 1 (kda_layers is 1-based), MLA in layer 0
    "kimi_linear": ("kimi_linear", _dense(
        "kimi_linear", num_key_value_heads=4, head_dim=16, rope_theta=100.0,
        linear_attn_config={"num_heads": 4, "head_dim": 16, "kda_layers": [2],
                            "short_conv_kernel_size": 4},
        model_max_length=1024, num_experts=4, num_experts_per_token=2,
        moe_intermediate_size=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8,
        v_head_dim=16)),
    # kimi_vl: multimodal wrapper around DeepSeek V3 (MLA), built text-only
    "kimi_vl": ("kimi_vl", dict(model_type="kimi_vl", text_config={
        **DEEPSEEK_MOE, "model_type": "deepseek_v3"})),
    # laguna: full attention in layer 0, sliding window in layer 1, per-layer head counts
    "laguna": ("laguna", _dense(
        "laguna", head_dim=16, rms_norm_eps=1e-6, sliding_window=8, partial_rotary_factor=0.5,
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=32, moe_routed_scaling_factor=2.5,
        moe_router_score_func="sqrtsoftplus",
        layer_types=["full_attention", "sliding_attention"], mlp_layer_types=["dense", "sparse"],
        num_attention_heads_per_layer=[4, 4],
        rope_parameters={
            "full_attention": {"rope_type": "yarn", "rope_theta": 500000.0, "factor": 8.0,
                               "original_max_position_embeddings": 4096, "beta_slow": 1.0,
                               "beta_fast": 32.0, "partial_rotary_factor": 0.5},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0,
                                  "partial_rotary_factor": 1.0}})),
    # lfm2-vl: multimodal wrapper around lfm2, built text-only
    "lfm2-vl": ("lfm2-vl", dict(model_type="lfm2-vl", text_config=dict(
        model_type="lfm2", vocab_size=V, hidden_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        norm_eps=1e-5, conv_bias=False, conv_L_cache=3, block_dim=64, block_ff_dim=128,
        block_multiple_of=16, block_ffn_dim_multiplier=1.0, block_auto_adjust_ff_dim=True,
        full_attn_idxs=[1], rope_theta=1000.0))),
    # lfm2: short-conv layer 0, attention layer 1
    "lfm2": ("lfm2", dict(
        model_type="lfm2", vocab_size=V, hidden_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        norm_eps=1e-5, conv_bias=False, conv_L_cache=3, block_dim=64, block_ff_dim=128,
        block_multiple_of=16, block_ffn_dim_multiplier=1.0, block_auto_adjust_ff_dim=True,
        full_attn_idxs=[1], rope_theta=1000.0)),
    "lfm2_moe": ("lfm2_moe", dict(
        model_type="lfm2_moe", vocab_size=V, hidden_size=64, intermediate_size=128,
        moe_intermediate_size=32, num_hidden_layers=2, num_experts=4, num_experts_per_tok=2,
        norm_topk_prob=True, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=1024, use_expert_bias=True, num_dense_layers=1, norm_eps=1e-5,
        conv_bias=False, conv_L_cache=3, full_attn_idxs=[1], rope_theta=1000.0)),
    "lille-130m": ("lille-130m", dict(
        model_type="lille-130m", block_size=1024, layer_norm_eps=1e-5, n_embd=64, n_head=4,
        n_kv_heads=2, n_layer=2, rope_theta=10000.0, vocab_size=V)),
    "llama": ("llama", _dense("llama", rope_theta=10000.0)),
    # llama with per-layer types: full, sliding (window 8), full
    "llama_sliding": ("llama", _dense(
        "llama", num_hidden_layers=3, rope_theta=10000.0, sliding_window=8,
        tie_word_embeddings=False,
        layer_types=["full_attention", "sliding_attention", "full_attention"])),
    # llama4: chunked attention (chunk 8) in layers 0-2, global NoPE attention in layer 3
    "llama4": ("llama4", dict(model_type="llama4", text_config=dict(
        model_type="llama4_text", attention_bias=False, attention_chunk_size=8, head_dim=16,
        hidden_size=64, interleave_moe_layer_step=2, intermediate_size=64,
        intermediate_size_mlp=128, max_position_embeddings=1024, num_attention_heads=4,
        num_experts_per_tok=1, num_hidden_layers=4, num_key_value_heads=2, num_local_experts=2,
        rms_norm_eps=1e-5, rope_scaling=None, rope_theta=1000.0, use_qk_norm=True,
        vocab_size=V))),
    "llama4_text": ("llama4_text", _dense(
        "llama4_text", head_dim=16, intermediate_size_mlp=128, rope_theta=1000.0,
        tie_word_embeddings=False, no_rope_layers=[1, 0], use_qk_norm=True)),
    "longcat_flash": ("longcat_flash", dict(
        model_type="longcat_flash", attention_method="MLA", zero_expert_type="identity",
        hidden_size=64, ffn_hidden_size=128, moe_topk=2, expert_ffn_hidden_size=32,
        n_routed_experts=4, zero_expert_num=2, num_layers=1, vocab_size=V,
        max_position_embeddings=1024, num_attention_heads=4, routed_scaling_factor=1.0,
        rms_norm_eps=1e-5, rope_theta=1000.0, mla_scale_q_lora=True, mla_scale_kv_lora=True,
        attention_bias=False, **MLA)),
    "longcat_flash_ngram": ("longcat_flash_ngram", dict(
        model_type="longcat_flash_ngram", zero_expert_type="identity",
        hidden_size=64, ffn_hidden_size=128, moe_topk=2, expert_ffn_hidden_size=32,
        n_routed_experts=4, zero_expert_num=2, num_layers=1, vocab_size=V,
        max_position_embeddings=1024, num_attention_heads=4, routed_scaling_factor=1.0,
        rms_norm_eps=1e-5, rope_theta=1000.0, mla_scale_q_lora=True, mla_scale_kv_lora=True,
        attention_bias=False, **MLA)),
    "mamba": ("mamba", dict(
        model_type="mamba", vocab_size=V, hidden_size=64, intermediate_size=128, state_size=16,
        num_hidden_layers=2, conv_kernel=4, use_bias=False, use_conv_bias=True,
        time_step_rank=8)),
    "mamba2": ("mamba2", dict(
        model_type="mamba2", num_heads=8, head_dim=16, vocab_size=V, hidden_size=64,
        intermediate_size=128, state_size=16, num_hidden_layers=2, layer_norm_epsilon=1e-5,
        conv_kernel=4, n_groups=1, use_bias=False, use_conv_bias=True, tie_word_embeddings=True,
        time_step_limit=(0.0, float("inf")), time_step_rank="auto")),
    # mellum: sliding window in layer 0, full attention in layer 1
    "mellum": ("mellum", _dense(
        "mellum", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=16,
        tie_word_embeddings=False, max_position_embeddings=1024, norm_topk_prob=True,
        sliding_window=8, layer_types=["sliding_attention", "full_attention"],
        rope_parameters={"sliding_attention": {"rope_theta": 10000.0},
                         "full_attention": {"rope_theta": 1000000.0}})),
    "mimo": ("mimo", _dense("mimo")),
    # mimo_v2_flash: full attention in layer 0, sliding window (with sinks) in layer 1
    "mimo_v2_flash": ("mimo_v2_flash", dict(
        model_type="mimo_v2_flash", num_experts_per_tok=2, hybrid_layer_pattern=[0, 1],
        moe_layer_freq=[0, 1], add_swa_attention_sink_bias=True,
        add_full_attention_sink_bias=False, sliding_window_size=8, vocab_size=V,
        hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, n_shared_experts=1, n_routed_experts=4,
        routed_scaling_factor=None, topk_method="noaux_tc", scoring_func="sigmoid",
        norm_topk_prob=True, n_group=1, topk_group=1, max_position_embeddings=1024,
        layernorm_epsilon=1e-5, rope_theta=1000.0, swa_rope_theta=1000.0,
        swa_num_attention_heads=4, swa_num_key_value_heads=2, head_dim=16, v_head_dim=8,
        swa_head_dim=16, swa_v_head_dim=8, partial_rotary_factor=0.5)),
    "minicpm": ("minicpm", _dense(
        "minicpm", dim_model_base=64, scale_depth=1.4, scale_emb=1.0)),
    "minicpm3": ("minicpm3", _dense(
        "minicpm3", dim_model_base=64, scale_depth=1.4, scale_emb=1.0, q_lora_rank=16,
        qk_nope_head_dim=16, qk_rope_head_dim=8, kv_lora_rank=16, max_position_embeddings=1024,
        rope_scaling={"original_max_position_embeddings": 1024, "short_factor": 1.0,
                      "long_factor": 1.0})),
    "minimax": ("minimax", _dense(
        "minimax", max_position_embeddings=1024, num_experts_per_tok=2, num_local_experts=4,
        shared_intermediate_size=64, rope_theta=1000.0, rotary_dim=8)),
    # minimax_m3_vl: full attention in layer 0, block-sparse (indexer) attention in layer 1
    "minimax_m3_vl": ("minimax_m3_vl", dict(model_type="minimax_m3_vl", text_config=dict(
        model_type="minimax_m3", hidden_size=64, intermediate_size=32,
        dense_intermediate_size=128, shared_intermediate_size=32, num_attention_heads=4,
        num_key_value_heads=2, num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2,
        max_position_embeddings=1024, head_dim=16, vocab_size=V,
        mlp_layer_types=["dense", "sparse"], layer_types=["full_attention", "sparse_attention"],
        index_n_heads=2, index_head_dim=16, index_block_size=4, index_topk_blocks=2,
        index_local_blocks=1))),
    "ministral3": ("ministral3", _dense(
        "ministral3", head_dim=16, max_position_embeddings=1024, sliding_window=8,
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters={"rope_theta": 10000.0, "rope_type": "default",
                         "llama_4_scaling_beta": 0.1, "original_max_position_embeddings": 1024})),
    # mistral3: multimodal wrapper (llama / ministral3 / mistral4 text), built text-only
    "mistral3": ("mistral3", dict(model_type="mistral3", text_config=_dense(
        "ministral3", head_dim=16, max_position_embeddings=1024,
        rope_parameters={"rope_theta": 10000.0, "rope_type": "default",
                         "llama_4_scaling_beta": 0.1, "original_max_position_embeddings": 1024}))),
    "mistral3_llama": ("mistral3", dict(model_type="mistral3", text_config=_dense(
        "mistral", rope_theta=1e6))),
    "mistral3_mistral4": ("mistral3", dict(model_type="mistral3", text_config={
        **DEEPSEEK_MOE, "model_type": "mistral4", "routed_scaling_factor": 1.0,
        "norm_topk_prob": True, "max_position_embeddings": 1024,
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "yarn", "factor": 1.0,
                            "original_max_position_embeddings": 1024, "beta_fast": 32.0,
                            "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                            "llama_4_scaling_beta": 0.1}})),
    "mistral4": ("mistral4", {
        **DEEPSEEK_MOE, "model_type": "mistral4", "routed_scaling_factor": 1.0,
        "norm_topk_prob": True, "max_position_embeddings": 1024,
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "yarn", "factor": 1.0,
                            "original_max_position_embeddings": 1024, "beta_fast": 32.0,
                            "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                            "llama_4_scaling_beta": 0.1}}),
    "mixtral": ("mixtral", _dense("mixtral", num_experts_per_tok=2, num_local_experts=4)),
    # muse_glimmer: sliding, sliding, sliding, full (the default pattern)
    "muse_glimmer": ("muse_glimmer", dict(
        model_type="muse_glimmer", hidden_size=64, num_hidden_layers=4, intermediate_size=128,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=V,
        sliding_window=8, max_position_embeddings=1024)),
    # nanbeige: the stack runs twice, each loop with its own caches
    "nanbeige": ("nanbeige", _dense("nanbeige", num_loops=2)),
    "nanochat": ("nanochat", dict(
        model_type="nanochat", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=V, intermediate_size=128)),
    "nemotron": ("nemotron", _dense("nemotron", hidden_act="relu2", norm_eps=1e-5)),
    # nemotron-nas: an attention layer, a no-op attention layer and a linear-replaced one
    # (only the first has a cache)
    "nemotron-nas": ("nemotron-nas", dict(
        model_type="nemotron-nas", hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
        rms_norm_eps=1e-5, vocab_size=V, block_configs=[
            {"attention": {"n_heads_in_group": 2, "no_op": False, "replace_with_linear": False},
             "ffn": {"ffn_mult": 1.0, "no_op": False, "replace_with_linear": False}},
            {"attention": {"n_heads_in_group": None, "no_op": True, "replace_with_linear": False},
             "ffn": {"ffn_mult": 1.0, "no_op": False, "replace_with_linear": False}},
            {"attention": {"n_heads_in_group": None, "no_op": False, "replace_with_linear": True},
             "ffn": {"ffn_mult": None, "no_op": True, "replace_with_linear": False}}])),
    # nemotron_h: Mamba2, attention, MLP and MoE layers (only M and * have caches)
    "nemotron_h": ("nemotron_h", dict(
        model_type="nemotron_h", vocab_size=V, hidden_size=64, intermediate_size=128,
        max_position_embeddings=1024, num_attention_heads=4, num_key_value_heads=2,
        attention_bias=False, mamba_num_heads=4, mamba_head_dim=16, mamba_proj_bias=False,
        ssm_state_size=16, conv_kernel=4, n_groups=1, mlp_bias=False, layer_norm_epsilon=1e-5,
        use_bias=False, use_conv_bias=True, hybrid_override_pattern=["M", "*", "-", "E"],
        moe_intermediate_size=32, moe_shared_expert_intermediate_size=32, n_group=1,
        n_routed_experts=4, n_shared_experts=1, topk_group=1, num_experts_per_tok=2,
        norm_topk_prob=True, routed_scaling_factor=1.0)),
    "olmo2": ("olmo2", _dense("olmo2", rope_theta=1000.0)),
    # olmo3: sliding, sliding, sliding, full
    "olmo3": ("olmo3", _dense(
        "olmo3", num_hidden_layers=4, rope_theta=1000.0, max_position_embeddings=1024,
        sliding_window=8)),
    # olmo_hybrid: gated-delta linear attention in layer 0, full attention in layer 1
    "olmo_hybrid": ("olmo_hybrid", _dense(
        "olmo_hybrid", max_position_embeddings=1024, linear_num_key_heads=2,
        linear_num_value_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
        linear_conv_kernel_dim=4, linear_allow_neg_eigval=True, tie_word_embeddings=False,
        attention_bias=False, layer_types=["linear_attention", "full_attention"])),
    "olmoe": ("olmoe", _dense("olmoe", num_experts=4, num_experts_per_tok=2)),
    "openelm": ("openelm", dict(
        model_type="openelm", head_dim=16, num_transformer_layers=2, model_dim=64, vocab_size=V,
        ffn_dim_divisor=16, num_query_heads=[4, 4], num_kv_heads=[2, 2],
        ffn_multipliers=[1.0, 2.0], normalize_qk_projections=True)),
    "phi": ("phi", dict(
        model_type="phi", max_position_embeddings=1024, vocab_size=V, hidden_size=64,
        num_attention_heads=4, num_hidden_layers=2, num_key_value_heads=2,
        partial_rotary_factor=0.5, intermediate_size=128, layer_norm_eps=1e-5)),
    "phi3": ("phi3", _dense("phi3")),
    # phi3small: layer 0 block-sparse attention (its own, not base sdpa), layer 1 dense.
    # The model sets the logits of 91 token ids in 100256..100351 to -inf, so the vocab
    # must reach 100352 (smaller vocabs scatter out of bounds and corrupt memory).
    "phi3small": ("phi3small", _dense(
        "phi3small", vocab_size=100352, dense_attention_every_n_layers=2,
        ff_intermediate_size=128, gegelu_limit=20.0, layer_norm_epsilon=1e-5)),
    "phimoe": ("phimoe", _dense(
        "phimoe", num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=1024,
        original_max_position_embeddings=1024, rope_scaling=None)),
    "phixtral": ("phixtral", dict(
        model_type="phixtral", num_vocab=V, model_dim=64, num_heads=4, num_layers=2,
        rotary_dim=8, num_experts_per_tok=2, num_local_experts=4)),
    "pixtral": ("pixtral", dict(model_type="pixtral", text_config=_dense("llama"))),
    # plamo: n_shared_head query heads per KV head
    "plamo": ("plamo", _dense("plamo", n_shared_head=2)),
    # plamo2: Mamba layer 0, attention layer 1
    "plamo2": ("plamo2", dict(
        model_type="plamo2", hidden_size=64, num_hidden_layers=2, rms_norm_eps=1e-6,
        num_attention_heads=4, num_key_value_heads=2, hidden_size_per_head=16, mamba_d_state=16,
        mamba_d_conv=4, mamba_num_heads=4, mamba_step=2, intermediate_size=128, vocab_size=V)),
    # plamo3: sliding, full
    "plamo3": ("plamo3", dict(
        model_type="plamo3", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, window_size=8,
        sliding_window_pattern=2, intermediate_size=128, vocab_size=V)),
    # prism_hadamard_qwen35: qwen3_5 with Hadamard-rotated 2-bit packed linears; the
    # manifest packs one MLP projection (all-zero packed weights)
    "prism_hadamard_qwen35": ("prism_hadamard_qwen35", dict(
        model_type="qwen3_5", schema_version=1, tensor_namespace="mlx-lm-text",
        gdn_activation_layout="grouped",
        quantization={"bits": 2, "group_size": 128, "mode": "affine"},
        modules=[{"path": "model.layers.3.mlp.down_proj", "embedding": False,
                  "dtype": "float16", "block": 512}],
        text_config=_qwen3_5_text("qwen3_5_text", intermediate_size=512))),
    "qwen": ("qwen", dict(
        model_type="qwen", hidden_size=64, num_attention_heads=4, num_hidden_layers=2,
        kv_channels=16, max_position_embeddings=1024, layer_norm_epsilon=1e-6,
        intermediate_size=256, no_bias=True, vocab_size=V)),
    "qwen2": ("qwen2", _dense("qwen2", rope_theta=1e6, max_position_embeddings=1024,
                              tie_word_embeddings=True)),
    "qwen2_moe": ("qwen2_moe", _dense(
        "qwen2_moe", num_experts_per_tok=2, num_experts=4, moe_intermediate_size=32,
        shared_expert_intermediate_size=64)),
    # qwen2_vl: multimodal wrapper around qwen2, built text-only
    "qwen2_vl": ("qwen2_vl", dict(model_type="qwen2_vl", text_config=_dense(
        "qwen2", rope_theta=1e6, max_position_embeddings=1024, tie_word_embeddings=True))),
    "qwen3": ("qwen3", _dense(
        "qwen3", head_dim=16, max_position_embeddings=1024, tie_word_embeddings=True,
        rope_theta=1e6)),
    # qwen3_5: gated-delta linear attention in layers 0-2, full attention in layer 3
    "qwen3_5": ("qwen3_5", dict(model_type="qwen3_5",
                                text_config=_qwen3_5_text("qwen3_5_text", intermediate_size=128))),
    "qwen3_5_moe": ("qwen3_5_moe", dict(model_type="qwen3_5_moe", text_config=_qwen3_5_text(
        "qwen3_5_moe_text", num_experts=4, num_experts_per_tok=2, shared_expert_intermediate_size=32,
        moe_intermediate_size=32))),
    "qwen3_moe": ("qwen3_moe", _dense(
        "qwen3_moe", head_dim=16, decoder_sparse_step=1, mlp_only_layers=[0],
        num_experts_per_tok=2, num_experts=4, moe_intermediate_size=32, rope_theta=1000.0,
        max_position_embeddings=1024, tie_word_embeddings=False, norm_topk_prob=True)),
    # qwen3_next: gated-delta linear attention in layers 0-2, full attention in layer 3
    "qwen3_next": ("qwen3_next", _dense(
        "qwen3_next", num_hidden_layers=4, linear_num_value_heads=2, linear_num_key_heads=2,
        linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
        num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1,
        shared_expert_intermediate_size=32, mlp_only_layers=[0], moe_intermediate_size=32,
        head_dim=16, rope_theta=1000.0, partial_rotary_factor=0.25,
        max_position_embeddings=1024, full_attention_interval=4)),
    # qwen3_vl: multimodal wrapper around qwen3, built text-only
    "qwen3_vl": ("qwen3_vl", dict(model_type="qwen3_vl", text_config=_dense(
        "qwen3", head_dim=16, max_position_embeddings=1024, tie_word_embeddings=False,
        rope_theta=1000.0))),
    "qwen3_vl_moe": ("qwen3_vl_moe", dict(model_type="qwen3_vl_moe", text_config=_dense(
        "qwen3_moe", head_dim=16, decoder_sparse_step=1, mlp_only_layers=[],
        num_experts_per_tok=2, num_experts=4, moe_intermediate_size=32, rope_theta=1000.0,
        max_position_embeddings=1024, tie_word_embeddings=False, norm_topk_prob=True))),
    # recurrent_gemma: recurrent, recurrent, local attention (window 8)
    "recurrent_gemma": ("recurrent_gemma", _dense(
        "recurrent_gemma", num_hidden_layers=3, attention_bias=False, conv1d_width=4,
        logits_soft_cap=30.0, rope_theta=10000.0, attention_window_size=8,
        block_types=["recurrent", "recurrent", "attention"])),
    "rwkv7": ("rwkv7", dict(
        model_type="rwkv7", vocab_size=V, hidden_size=64, intermediate_size=128, norm_eps=1e-5,
        head_dim=16, num_hidden_layers=2, a_low_rank_dim=8, v_low_rank_dim=8,
        gate_low_rank_dim=8, decay_low_rank_dim=8)),
    "seed_oss": ("seed_oss", _dense("seed_oss", head_dim=16)),
    "smollm3": ("smollm3", _dense("smollm3", no_rope_layer_interval=2)),
    "solar_open": ("solar_open", _dense(
        "solar_open", moe_intermediate_size=32, head_dim=16, n_shared_experts=1,
        n_routed_experts=4, routed_scaling_factor=1.0, num_experts_per_tok=2,
        first_k_dense_replace=1, norm_topk_prob=True, max_position_embeddings=1024,
        rope_theta=1000.0, tie_word_embeddings=False, partial_rotary_factor=1.0)),
    # spark2_5: sliding, full
    "spark2_5": ("spark2_5", _dense(
        "spark2_5", head_dim=16, sliding_window=8,
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters={"sliding_attention": {"rope_theta": 10000.0},
                         "full_attention": {"rope_theta": 1000000.0}})),
    "stablelm": ("stablelm", _dense(
        "stablelm", rope_theta=10000.0, use_qkv_bias=True, partial_rotary_factor=0.25,
        layer_norm_eps=1e-5)),
    "starcoder2": ("starcoder2", _dense("starcoder2", norm_epsilon=1e-5)),
    # step3p5: full attention in layer 0, sliding window in layer 1 (different head counts)
    "step3p5": ("step3p5", dict(
        model_type="step3p5", hidden_size=64, num_hidden_layers=2, vocab_size=V,
        num_attention_heads=4, num_attention_groups=2, head_dim=16, intermediate_size=128,
        rms_norm_eps=1e-5, rope_theta=[10000.0, 10000.0], sliding_window=8,
        layer_types=["full_attention", "sliding_attention"], partial_rotary_factors=[0.5, 1.0],
        attention_other_setting={"num_attention_heads": 2, "num_attention_groups": 2},
        use_head_wise_attn_gate=True, moe_num_experts=4, moe_top_k=2, moe_intermediate_size=32,
        share_expert_dim=32, moe_layers_enum="1")),
    "talkie": ("talkie", dict(
        model_type="talkie", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        head_dim=16, intermediate_size=128, vocab_size=V, max_position_embeddings=1024)),
    "telechat3": ("telechat3", _dense(
        "telechat3", rope_theta=10000.0, max_position_embeddings=1024)),
    "youtu_llm": ("youtu_llm", dict(
        model_type="youtu_llm", vocab_size=V, hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16,
        q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
        max_position_embeddings=1024)),
}

# Built fine on any backend, but their forward pass calls Metal kernels
# (mx.fast.metal_kernel) with no fallback, so they run only where Metal is available
# (mx.metal.is_available()). Not verified on CPU; no FACTS.
METAL_ONLY = {
    # bitnet: BitLinear layers run a custom Metal matmul kernel
    "bitnet": ("bitnet", _dense("bitnet")),
    # muse_spark: sliding in layer 0, full attention (no RoPE) in layer 1, MoE everywhere;
    # fused Metal kernels for qk-norm/RoPE, gating, expert routing and norms
    "muse_spark": ("muse_spark", dict(model_type="muse_spark", text_config=dict(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_hidden_layers=2, vocab_size=V, rms_norm_eps=1e-5, post_norm_eps=1e-8,
        rope_parameters={"rope_theta": 10000.0}, layer_rope_theta=[10000.0, 0],
        layer_types=["sliding_attention", "full_attention"], sliding_window=8,
        final_logit_softcapping=30.0, output_multiplier=0.2, num_local_experts=4,
        num_experts_per_tok=2, moe_hidden_size=32, moe_intermediate_size=32))),
}


def build(name: str, seed: int = 0, dtype=mx.float32):
    """A tiny random-weight model for ZOO[name], parameters cast to dtype and evaluated."""
    module_name, args = ZOO[name] if name in ZOO else METAL_ONLY[name]
    module = importlib.import_module(f"mlx_lm.models.{module_name}")
    # Some ModelArgs mutate their (nested) dicts in __post_init__.
    model_args = module.ModelArgs.from_dict(copy.deepcopy(args))
    mx.random.seed(seed)
    model = module.Model(model_args)
    model.set_dtype(dtype)
    mx.eval(model.parameters())
    return model


def vocab(name: str) -> int:
    """The last dimension of the logits of build(name)."""
    return 100352 if name == "phi3small" else V


# Entries with MoE expert layers (mlx_lm.models.switch_layers, i.e. mx.gather_mm). On CPU,
# mlx 0.32's GatherMM supports only float32, so these raise RuntimeError in float16 and
# bfloat16 there; every other entry also runs in float16 and bfloat16 on CPU.
MOE = frozenset({
    "Klear", "afmoe", "bailing_hybrid", "bailing_moe", "bailing_moe_linear",
    "bailing_moe_v3", "deepseek", "deepseek_v2", "deepseek_v3", "deepseek_v32",
    "deepseek_v41", "dots1", "ernie4_5_moe", "exaone_moe", "glm4_moe", "glm4_moe_lite",
    "glm_moe_dsa", "gpt_oss", "granitemoe", "granitemoehybrid", "hunyuan", "jamba",
    "kimi_k25", "kimi_k3", "kimi_linear", "kimi_vl", "laguna", "lfm2_moe", "llama4",
    "longcat_flash", "longcat_flash_ngram", "mellum", "mimo_v2_flash", "minimax",
    "minimax_m3_vl", "mistral3_mistral4", "mistral4", "mixtral", "nemotron_h", "olmoe",
    "phimoe", "phixtral", "qwen2_moe", "qwen3_5_moe", "qwen3_moe", "qwen3_next",
    "qwen3_vl_moe", "solar_open", "step3p5"
})

_LATENT = ("MLA latent cache: keys [B, 1, L, kv_lora_rank], 'values' its RoPE part "
           "[B, 1, L, qk_rope_head_dim]; the prompt's attention call gets per-head K/V "
           "expanded from it")
_PER_HEAD_MLA = "MLA cached per head: keys of head dim 24 (nope + rope), values of 16"

# What is unusual about the forward pass or the caches (all take the plain
# `model(tokens, cache=make_prompt_cache(model))` call; nothing needs extra inputs).
NOTES = {
    "phi3small": "vocab must reach 100352: the model sets the logits of 91 token ids in "
                 "100256..100351 to -inf (a smaller vocab scatters out of bounds and "
                 "corrupts memory); layer 0's block-sparse attention does not use base sdpa",
    "afm7": "4 layers, 2 caches: the 2 KV-reuse layers read cache[-1].keys_and_values() "
            "and call the attention function with cache=None",
    "gemma3n": "4 layers, 2 caches: KV-shared layers call keys_and_values() on their "
               "source layer's cache and pass that cache to the attention function again",
    "gemma4": "4 layers, 2 caches: KV-shared layers get the K/V arrays of their source "
              "layer and call the attention function with cache=None",
    "gemma4_text": "as gemma4",
    "iquestloopcoder": "2 layers, 4 caches (loop 1: KVCache, loop 2: RotatingKVCache); loop 2 "
                       "calls attention twice per layer: over loop 1's K/V (passing its own "
                       "window cache) and over its window",
    "nanbeige": "2 layers run twice: 4 caches, one per layer per loop",
    "nemotron-nas": "3 layers, 2 caches: the no-op layer gets none; the linear-replaced "
                    "layer gets a KVCache it never uses",
    "nemotron_h": "4 layers, 2 caches (Mamba: ArraysCache, attention: KVCache); MLP and "
                  "MoE layers get none",
    "longcat_flash": "1 layer with 2 attention sublayers: one CacheList[KVCache, KVCache]; "
                     + _LATENT,
    "longcat_flash_ngram": "an extra ArraysCache (n-gram context) before the layer caches; "
                           "otherwise as longcat_flash",
    "deepseek_v41": "its own LayerCache (window + compressed KV + indexer keys), not an "
                    "mlx-lm cache class; its own sparse attention, no base sdpa",
    "deepseek_v32": "CacheList[MLA latent KVCache, indexer key KVCache] per layer; the "
                    "attention function gets the CacheList as `cache`; " + _LATENT,
    "glm_moe_dsa": "as deepseek_v32",
    "minimax_m3_vl": "CacheList per layer: [KVCache] for full attention, [KVCache, indexer "
                     "KVCache with empty values] for sparse attention",
    "baichuan_m1": "CacheList[ArraysCache (conv), RotatingKVCache or KVCache] per layer",
    "falcon_h1": "CacheList[ArraysCache (Mamba2), KVCache] per layer (parallel hybrid)",
    "llama4": "ChunkedKVCache (chunk 8) for the chunked-attention layers",
    "plamo": "tiles its KV heads before the attention call (cache holds fewer heads)",
    "gemma2": "own attention (logit softcapping), no base sdpa",
    "plamo2": "its attention layer does not use base sdpa",
    "mamba": "no attention: ArraysCache only",
    "mamba2": "no attention: ArraysCache only",
    "rwkv7": "no attention: ArraysCache only",
    "recurrent_gemma": "no plain KVCache: RotatingKVCache for the local-attention layer",
    "hunyuan": "cross-layer attention: layer 1 reuses layer 0's K/V projections but stores "
               "them in its own cache",
    "gpt_oss": "attention sinks passed to the attention function",
    "mimo_v2_flash": "attention sinks on the sliding layer; v_head_dim 8 != head_dim 16",
    **{name: _LATENT for name in (
        "deepseek_v3", "kimi_k25", "kimi_vl", "glm4_moe_lite", "mistral4", "mistral3_mistral4",
        "bailing_hybrid", "bailing_moe_v3", "kimi_k3", "kimi_linear")},
    **{name: _PER_HEAD_MLA for name in ("deepseek_v2", "minicpm3", "youtu_llm")},
    "prism_hadamard_qwen35": "needs a packed-module manifest: one MLP projection is a "
                             "2-bit Hadamard-rotated packed linear with all-zero weights",
}

# Every file in mlx_lm/models/ (mlx-lm 0.32.2) without a ZOO entry, and why.
SKIPPED = {
    "__init__": "not a model: package init",
    "activations": "not a model: activation functions",
    "base": "not a model: BaseModelArgs, masks, scaled_dot_product_attention",
    "bitlinear_layers": "not a model: BitLinear layer (Metal kernel) for bitnet",
    "cache": "not a model: the KV / arrays cache classes",
    "gated_delta": "not a model: gated delta-rule ops and kernel for linear attention",
    "mla": "not a model: MultiLinear helper for multi-head latent attention",
    "pipeline": "not a model: PipelineMixin for pipeline parallelism",
    "rope_utils": "not a model: RoPE variants",
    "ssm": "not a model: Mamba2 SSM ops",
    "switch_layers": "not a model: MoE SwitchGLU / SwitchLinear layers",
    "bitnet": "forward needs a Metal kernel (BitLinear matmul), no CPU path: config in METAL_ONLY",
    "muse_spark": "forward needs Metal kernels (fused norms, RoPE, routing), no CPU path: "
                  "config in METAL_ONLY",
    "olmo": "cannot run: import calls sys.exit(1) unless ai2-olmo (hf_olmo) is installed, and "
            "even with it stubbed a multi-token forward fails (it adds the 'causal' mask "
            "string to the scores: ValueError); mlx-lm's own test of it is skipped",
}

# Facts a one-off scan found (mlx-lm 0.32.2; /tmp script: build, a 16-token prompt, one
# decode step, with mlx_lm.models.base.scaled_dot_product_attention and the caches'
# update_and_fetch / keys_and_values wrapped). Per ZOO name:
#   caches: class names of make_prompt_cache(model) (mlx-lm's make_cache() or, without
#       one, a KVCache per layer); a CacheList as "CacheList[inner,...]"
#   n_layers: len(model.layers) (caches can be fewer: shared KV, layers without
#       attention; or more: looped stacks, extra n-gram caches)
#   sdpa_calls: calls of base.scaled_dot_product_attention in the prompt pass
#   sdpa_cache_types: class names of the `cache` argument of those calls ("NoneType":
#       a KV-sharing layer that passes no cache)
#   make_cache: the model defines make_cache()
#   base_sdpa: a module the model's layers come from has the global
#       scaled_dot_product_attention bound to mlx_lm.models.base's (what
#       h2o_fn.adapters.attention hooks)
#   kv_without_sdpa: indices of top-level plain-KVCache entries never passed to the base
#       attention function (their layer computes attention its own way)
#   mla: some cache stores keys and values of different head dims (multi-head latent
#       attention; key-only indexer caches not counted)
#   sdpa_kv_differs: some attention call gets keys with a different head count or head
#       dim than its cache stores (MLA caches keep the latent, expanded per head for the
#       prompt; plamo tiles its KV heads)
#   sinks: attention sinks are passed to the attention function
#   shared_kv: some layer attends over K/V another layer's cache holds (afm7, gemma3n,
#       gemma4: KV-shared layers; iquestloopcoder: loop 2 attends over loop 1's K/V)
#   cache_seen_twice: one cache object is the `cache` argument of two attention calls in
#       one forward (gemma3n's shared layers pass their source cache; iquestloopcoder's
#       loop 2 passes its window cache to both its global and its local attention)
#   cache_list: make_cache() returns CacheList entries


def _f(caches, n_layers, sdpa_calls, sdpa_cache_types=("KVCache",), **flags):
    facts = dict(caches=list(caches), n_layers=n_layers, sdpa_calls=sdpa_calls,
                 sdpa_cache_types=list(sdpa_cache_types), make_cache=False, base_sdpa=True,
                 kv_without_sdpa=[], mla=False, sdpa_kv_differs=False, sinks=False,
                 shared_kv=False, cache_seen_twice=False, cache_list=False)
    assert set(flags) <= set(facts), set(flags) - set(facts)
    return {**facts, **flags}


FACTS = {
    "Klear": _f(["KVCache"] * 2, 2, 2),
    "afm7": _f(["KVCache"] * 2, 4, 4, ["KVCache", "NoneType"], make_cache=True,
        shared_kv=True),
    "afmoe": _f(["RotatingKVCache", "KVCache", "RotatingKVCache"], 3, 3,
        ["KVCache", "RotatingKVCache"], make_cache=True),
    "apertus": _f(["KVCache"] * 2, 2, 2),
    "baichuan_m1": _f(
        ["CacheList[ArraysCache,RotatingKVCache]", "CacheList[ArraysCache,KVCache]"], 2, 2,
        ["KVCache", "RotatingKVCache"], make_cache=True, cache_list=True),
    "bailing_hybrid": _f(["ArraysCache", "KVCache"], 2, 1, make_cache=True, mla=True,
        sdpa_kv_differs=True),
    "bailing_moe": _f(["KVCache"] * 2, 2, 2),
    "bailing_moe_linear": _f(["ArraysCache", "KVCache"], 2, 1, make_cache=True),
    "bailing_moe_v3": _f(["ArraysCache", "KVCache"], 2, 1, make_cache=True, mla=True,
        sdpa_kv_differs=True),
    "cohere": _f(["KVCache"] * 2, 2, 2),
    "cohere2": _f(["RotatingKVCache", "RotatingKVCache", "RotatingKVCache", "KVCache"], 4, 4,
        ["KVCache", "RotatingKVCache"], make_cache=True),
    "dbrx": _f(["KVCache"] * 2, 2, 2),
    "deepseek": _f(["KVCache"] * 2, 2, 2),
    "deepseek_v2": _f(["KVCache"] * 2, 2, 2, mla=True),
    "deepseek_v3": _f(["KVCache"] * 2, 2, 2, mla=True, sdpa_kv_differs=True),
    "deepseek_v32": _f(["CacheList[KVCache,KVCache]"] * 2, 2, 2, ["CacheList"],
        make_cache=True, mla=True, sdpa_kv_differs=True, cache_list=True),
    "deepseek_v41": _f(["LayerCache"] * 2, 2, 0, [], make_cache=True, base_sdpa=False),
    "dots1": _f(["KVCache"] * 2, 2, 2),
    "ernie4_5": _f(["KVCache"] * 2, 2, 2),
    "ernie4_5_moe": _f(["KVCache"] * 2, 2, 2),
    "exaone": _f(["KVCache"] * 2, 2, 2),
    "exaone4": _f(["RotatingKVCache", "RotatingKVCache", "KVCache", "RotatingKVCache"], 4, 4,
        ["KVCache", "RotatingKVCache"], make_cache=True),
    "exaone_moe": _f(["RotatingKVCache", "KVCache"], 2, 2, ["KVCache", "RotatingKVCache"],
        make_cache=True),
    "falcon_h1": _f(["CacheList[ArraysCache,KVCache]"] * 2, 2, 2, make_cache=True,
        cache_list=True),
    "gear": _f(["ArraysCache", "RotatingKVCache", "KVCache"], 3, 2,
        ["KVCache", "RotatingKVCache"], make_cache=True),
    "gemma": _f(["KVCache"] * 2, 2, 2),
    "gemma2": _f(["KVCache"] * 2, 2, 0, [], base_sdpa=False, kv_without_sdpa=[0, 1]),
    "gemma3": _f(["RotatingKVCache", "RotatingKVCache", "KVCache"], 3, 3,
        ["KVCache", "RotatingKVCache"], make_cache=True),
    "gemma3_text": _f(["RotatingKVCache", "RotatingKVCache", "KVCache"], 3, 3,
        ["KVCache", "RotatingKVCache"], make_cache=True),
    "gemma3n": _f(["RotatingKVCache", "KVCache"], 4, 4, ["KVCache", "RotatingKVCache"],
        make_cache=True, shared_kv=True, cache_seen_twice=True),
    "gemma4": _f(["RotatingKVCache", "KVCache"], 4, 4,
        ["KVCache", "NoneType", "RotatingKVCache"], make_cache=True, shared_kv=True),
    "gemma4_text": _f(["RotatingKVCache", "KVCache"], 4, 4,
        ["KVCache", "NoneType", "RotatingKVCache"], make_cache=True, shared_kv=True),
    "glm": _f(["KVCache"] * 2, 2, 2),
    "glm4": _f(["KVCache"] * 2, 2, 2),
    "glm4_moe": _f(["KVCache"] * 2, 2, 2),
    "glm4_moe_lite": _f(["KVCache"] * 2, 2, 2, mla=True, sdpa_kv_differs=True),
    "glm_moe_dsa": _f(["CacheList[KVCache,KVCache]"] * 2, 2, 2, ["CacheList"],
        make_cache=True, mla=True, sdpa_kv_differs=True, cache_list=True),
    "gpt2": _f(["KVCache"] * 2, 2, 2),
    "gpt_bigcode": _f(["KVCache"] * 2, 2, 2),
    "gpt_neox": _f(["KVCache"] * 2, 2, 2),
    "gpt_oss": _f(["RotatingKVCache", "KVCache"], 2, 2, ["KVCache", "RotatingKVCache"],
        make_cache=True, sinks=True),
    "gptj": _f(["KVCache"] * 2, 2, 2),
    "granite": _f(["KVCache"] * 2, 2, 2),
    "granitemoe": _f(["KVCache"] * 2, 2, 2),
    "granitemoehybrid": _f(["ArraysCache", "KVCache"], 2, 1, make_cache=True),
    "helium": _f(["KVCache"] * 2, 2, 2),
    "hunyuan": _f(["KVCache"] * 2, 2, 2),
    "hunyuan_v1_dense": _f(["KVCache"] * 2, 2, 2),
    "internlm2": _f(["KVCache"] * 2, 2, 2),
    "internlm3": _f(["KVCache"] * 2, 2, 2),
    "iquestloopcoder": _f(["KVCache", "KVCache", "RotatingKVCache", "RotatingKVCache"], 2, 6,
        ["KVCache", "RotatingKVCache"], make_cache=True, shared_kv=True,
        cache_seen_twice=True),
    "jamba": _f(["ArraysCache", "KVCache"], 2, 1, make_cache=True),
    "kimi_k25": _f(["KVCache"] * 2, 2, 2, mla=True, sdpa_kv_differs=True),
    "kimi_k3": _f(["ArraysCache", "KVCache"], 2, 1, make_cache=True, mla=True,
        sdpa_kv_differs=True),
    "kimi_linear": _f(["KVCache", "ArraysCache"], 2, 1, make_cache=True, mla=True,
        sdpa_kv_differs=True),
    "kimi_vl": _f(["KVCache"] * 2, 2, 2, mla=True, sdpa_kv_differs=True),
    "laguna": _f(["KVCache", "RotatingKVCache"], 2, 2, ["KVCache", "RotatingKVCache"],
        make_cache=True),
    "lfm2-vl": _f(["ArraysCache", "KVCache"], 2, 1, make_cache=True),
    "lfm2": _f(["ArraysCache", "KVCache"], 2, 1, make_cache=True),
    "lfm2_moe": _f(["ArraysCache", "KVCache"], 2, 1, make_cache=True),
    "lille-130m": _f(["KVCache"] * 2, 2, 2),
    "llama": _f(["KVCache"] * 2, 2, 2, make_cache=True),
    "llama_sliding": _f(["KVCache", "RotatingKVCache", "KVCache"], 3, 3,
        ["KVCache", "RotatingKVCache"], make_cache=True),
    "llama4": _f(["ChunkedKVCache", "ChunkedKVCache", "ChunkedKVCache", "KVCache"], 4, 4,
        ["ChunkedKVCache", "KVCache"], make_cache=True),
    "llama4_text": _f(["KVCache"] * 2, 2, 2),
    "longcat_flash": _f(["CacheList[KVCache,KVCache]"], 1, 2, make_cache=True, mla=True,
        sdpa_kv_differs=True, cache_list=True),
    "longcat_flash_ngram": _f(["ArraysCache", "CacheList[KVCache,KVCache]"], 1, 2,
        make_cache=True, mla=True, sdpa_kv_differs=True, cache_list=True),
    "mamba": _f(["ArraysCache"] * 2, 2, 0, [], make_cache=True, base_sdpa=False),
    "mamba2": _f(["ArraysCache"] * 2, 2, 0, [], make_cache=True, base_sdpa=False),
    "mellum": _f(["RotatingKVCache", "KVCache"], 2, 2, ["KVCache", "RotatingKVCache"],
        make_cache=True),
    "mimo": _f(["KVCache"] * 2, 2, 2),
    "mimo_v2_flash": _f(["KVCache", "RotatingKVCache"], 2, 2, ["KVCache", "RotatingKVCache"],
        make_cache=True, mla=True, sinks=True),
    "minicpm": _f(["KVCache"] * 2, 2, 2),
    "minicpm3": _f(["KVCache"] * 2, 2, 2, mla=True),
    "minimax": _f(["KVCache"] * 2, 2, 2),
    "minimax_m3_vl": _f(["CacheList[KVCache]", "CacheList[KVCache,KVCache]"], 2, 2,
        make_cache=True, cache_list=True),
    "ministral3": _f(["RotatingKVCache", "KVCache"], 2, 2, ["KVCache", "RotatingKVCache"],
        make_cache=True),
    "mistral3": _f(["KVCache"] * 2, 2, 2),
    "mistral3_llama": _f(["KVCache"] * 2, 2, 2),
    "mistral3_mistral4": _f(["KVCache"] * 2, 2, 2, mla=True, sdpa_kv_differs=True),
    "mistral4": _f(["KVCache"] * 2, 2, 2, mla=True, sdpa_kv_differs=True),
    "mixtral": _f(["KVCache"] * 2, 2, 2),
    "muse_glimmer": _f(["RotatingKVCache", "RotatingKVCache", "RotatingKVCache", "KVCache"],
        4, 4, ["KVCache", "RotatingKVCache"], make_cache=True),
    "nanbeige": _f(["KVCache"] * 4, 2, 4, make_cache=True),
    "nanochat": _f(["KVCache"] * 2, 2, 2),
    "nemotron": _f(["KVCache"] * 2, 2, 2),
    "nemotron-nas": _f(["KVCache"] * 2, 3, 1, make_cache=True, kv_without_sdpa=[1]),
    "nemotron_h": _f(["ArraysCache", "KVCache"], 4, 1, make_cache=True),
    "olmo2": _f(["KVCache"] * 2, 2, 2),
    "olmo3": _f(["RotatingKVCache", "RotatingKVCache", "RotatingKVCache", "KVCache"], 4, 4,
        ["KVCache", "RotatingKVCache"], make_cache=True),
    "olmo_hybrid": _f(["ArraysCache", "KVCache"], 2, 1, make_cache=True),
    "olmoe": _f(["KVCache"] * 2, 2, 2),
    "openelm": _f(["KVCache"] * 2, 2, 2),
    "phi": _f(["KVCache"] * 2, 2, 2),
    "phi3": _f(["KVCache"] * 2, 2, 2),
    "phi3small": _f(["KVCache"] * 2, 2, 1, kv_without_sdpa=[0]),
    "phimoe": _f(["KVCache"] * 2, 2, 2),
    "phixtral": _f(["KVCache"] * 2, 2, 2),
    "pixtral": _f(["KVCache"] * 2, 2, 2),
    "plamo": _f(["KVCache"] * 2, 2, 2, sdpa_kv_differs=True),
    "plamo2": _f(["ArraysCache", "KVCache"], 2, 0, [], make_cache=True, base_sdpa=False,
        kv_without_sdpa=[1]),
    "plamo3": _f(["RotatingKVCache", "KVCache"], 2, 2, ["KVCache", "RotatingKVCache"],
        make_cache=True),
    "prism_hadamard_qwen35": _f(["ArraysCache", "ArraysCache", "ArraysCache", "KVCache"], 4,
        1, make_cache=True),
    "qwen": _f(["KVCache"] * 2, 2, 2),
    "qwen2": _f(["KVCache"] * 2, 2, 2),
    "qwen2_moe": _f(["KVCache"] * 2, 2, 2),
    "qwen2_vl": _f(["KVCache"] * 2, 2, 2),
    "qwen3": _f(["KVCache"] * 2, 2, 2),
    "qwen3_5": _f(["ArraysCache", "ArraysCache", "ArraysCache", "KVCache"], 4, 1,
        make_cache=True),
    "qwen3_5_moe": _f(["ArraysCache", "ArraysCache", "ArraysCache", "KVCache"], 4, 1,
        make_cache=True),
    "qwen3_moe": _f(["KVCache"] * 2, 2, 2),
    "qwen3_next": _f(["ArraysCache", "ArraysCache", "ArraysCache", "KVCache"], 4, 1,
        make_cache=True),
    "qwen3_vl": _f(["KVCache"] * 2, 2, 2),
    "qwen3_vl_moe": _f(["KVCache"] * 2, 2, 2),
    "recurrent_gemma": _f(["ArraysCache", "ArraysCache", "RotatingKVCache"], 3, 1,
        ["RotatingKVCache"], make_cache=True),
    "rwkv7": _f(["ArraysCache"] * 2, 2, 0, [], make_cache=True, base_sdpa=False),
    "seed_oss": _f(["KVCache"] * 2, 2, 2),
    "smollm3": _f(["KVCache"] * 2, 2, 2),
    "solar_open": _f(["KVCache"] * 2, 2, 2),
    "spark2_5": _f(["RotatingKVCache", "KVCache"], 2, 2, ["KVCache", "RotatingKVCache"],
        make_cache=True),
    "stablelm": _f(["KVCache"] * 2, 2, 2),
    "starcoder2": _f(["KVCache"] * 2, 2, 2),
    "step3p5": _f(["KVCache", "RotatingKVCache"], 2, 2, ["KVCache", "RotatingKVCache"],
        make_cache=True),
    "talkie": _f(["KVCache"] * 2, 2, 2),
    "telechat3": _f(["KVCache"] * 2, 2, 2),
    "youtu_llm": _f(["KVCache"] * 2, 2, 2, mla=True),
}
