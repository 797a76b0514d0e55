"""One module per patch; each exports ``PATCH`` (a :class:`torchpatches._core.declare.Patch`)."""

#: Patch modules in the order they apply and are reported: compile-time patches, the FLUX eager fusions, those
#: of SD3, Wan, QwenImage, Z-Image / Ideogram 4, HunyuanVideo 1.5 and Krea 2, then peft's LoRA layers and diffusers' LoRA
#: scale walk, then context parallelism's collectives.
PATCH_MODULES = (
    "inductor_realize", "inductor_opaque_strides", "inductor_fallback_log", "inductor_cpp_indirect_assert",
    "inductor_pattern_dtypes", "aot_compile_builtins", "compile_warnings", "rope",
    "adaln", "qk_norm_rope", "gate_residual", "gelu_gemm", "swiglu", "rope_tables",
    "sd3_qk_norm", "sd3_block",
    "wan_block", "wan_qk_norm_rope",
    "qwenimage_block", "qwenimage_qk_norm_rope", "qwenimage_text_seq_len",
    "rms_sandwich_block", "rms_sandwich_qk_norm_rope", "hunyuanvideo15", "krea2", "kandinsky6", "flux3",
    "qwenimage21", "ltx2",
    "lora", "lora_scale",
    "cp_all_to_all", "cp_ring_attention", "cp_ulysses_anything",
)
