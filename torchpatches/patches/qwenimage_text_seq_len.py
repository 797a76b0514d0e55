"""qwenimage_text_seq_len: QwenImage's text-length helper without a host-to-device copy (a CUDA-graph capture blocker).

What goes wrong upstream
    Every QwenImage forward given a text mask (what ``QwenImagePipeline`` passes) calls
    ``compute_text_seq_len_from_mask``, which builds the fallback length as ``torch.as_tensor(text_seq_len,
    device=...)``: a Python int copied from pageable host memory to the GPU. torch makes that copy blocking, so the
    host waits for the GPU once per forward (a pipeline's next step cannot be queued behind the running one), and a
    CUDA-graph capture of the model fails ("Cannot copy between CPU and CUDA tensors during CUDA graph capture unless
    the CPU tensor is pinned"): ``torchpatches.cuda_graphs.graphed`` ran QwenImage eagerly (docs/notes/context_parallel.md,
    "The uneven modes"). The transformer discards the per-sample lengths the tensor feeds. No upstream issue as of
    diffusers 0.42.1.

What the patch changes
    The same function with that scalar made on the device by a fill (``position_ids.new_full((), text_seq_len)``:
    int64, as ``as_tensor`` of an int, on the hidden states' device): the same three results, bit for bit, without
    the copy.
    The original runs under torch.compile (Dynamo traces diffusers' code). ``controlnet_qwenimage``, which imports the
    function by name, gets the replacement too. Not patched: ``transformer_nucleusmoe_image``'s own copy of the
    function (``_compute_text_seq_len_from_mask``), which makes the same copy.

Versions
    diffusers 0.38 - 0.42: ``compute_text_seq_len_from_mask`` fingerprinted in 0.38.0, 0.39.0, 0.40.0, 0.41.0, 0.42.0
    and 0.42.1, one source (tools/fingerprint_diffusers.py). Any torch.

When to delete
    When diffusers builds the fallback length on the device (or drops the per-sample lengths nobody reads).
"""
from .._core.declare import Patch, Target

_BODY = "torchpatches.patches._bodies.qwenimage_text_seq_len"
_MODULE = "diffusers.models.transformers.transformer_qwenimage"


PATCH = Patch("qwenimage_text_seq_len", targets=Target(
    f"{_MODULE}:compute_text_seq_len_from_mask", f"{_BODY}:_replacement", {"7df03db69ecf3bef"},  # 0.38.0 - 0.42.1
    aliases=("diffusers.models.controlnets.controlnet_qwenimage:compute_text_seq_len_from_mask",)),
    summary="QwenImage's text-length helper without a blocking host-to-device copy (CUDA-graph capture)",
    requires={"diffusers": ">=0.38,<0.43"})
