"""What FLUX.1's single blocks would gain without the ``[attention | gelu(mlp)]`` buffer (issue 17, goal 2).

Measured, not built: the package's ``gate_residual`` writes the attention output and ``gelu(proj_mlp(x))`` into the
column halves of one ``[M, 3072 + 12288]`` buffer (two row kernels, about 93 us of an H200 per block, 38 blocks) so
that ``proj_out`` is one GEMM, as diffusers' ``torch.cat`` + ``proj_out`` compute it. Two other forms:

- ``split``: the GELU in ``proj_mlp``'s GEMM epilogue (cuBLASLt, as ``gelu_gemm`` does for the double blocks) and
  ``proj_out`` as two GEMMs over the two halves of its weight, the second accumulating into the first's output
  (``addmm_`` with beta = 1). No buffer, no row kernels; one rounding more than diffusers (the first half's partial
  sum is rounded to bf16 before the second adds to it) and one less (the GELU reads the fp32 accumulator).
- ``strided``: the GELU epilogue writing straight into the buffer's right half (``torch._addmm_activation(...,
  out=buf[:, 3072:])``); the attention output copied as today. Whether torch sends a strided ``out`` to cuBLASLt's
  epilogue is what part 1 finds out (the kernels it launches are listed).

Part 1, one block's tail at FLUX.1-dev shapes (M = 4608 tokens, bf16, random data): GPU us per block of each form
(CUDA events over ``--reps`` repetitions, forms alternated in ``--rounds`` rounds), the kernels each launches, and
the output against the package's form (bit-identical to diffusers'; ``fused.compare``: ulps at the larger of the two
outputs and the first half's partial sum) and against a float64 reference.

Part 2 is ``benchmarks/dit.py`` with the rows ``eager/single:split`` and ``eager/single:strided`` (``_bench.state``
hands ``single:NAME`` to :func:`variant`): every patch applied, FLUX.1's single blocks in that form.

    python benchmarks/split_proj_out.py --json out.json
    python benchmarks/dit.py --models flux1 --variants eager,single:split,single:strided,regional --rounds 3
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # _bench beside this file
import _bench  # noqa: E402,I001  (before torch: turns Inductor's caches off)

import argparse  # noqa: E402
import contextlib  # noqa: E402
import statistics  # noqa: E402
from typing import Any, Callable, Dict, Iterator, List, Optional  # noqa: E402

import torch  # noqa: E402

from fused import compare  # noqa: E402

FORMS = ("buffer", "split", "strided")
M, WIDTH, MLP = 4608, 3072, 12288  # FLUX.1-dev at 1024x1024: 4096 image + 512 text tokens


def buffer_tail(x: torch.Tensor, attn: torch.Tensor, w_mlp: torch.Tensor, b_mlp: torch.Tensor, w_out: torch.Tensor,
                b_out: torch.Tensor) -> torch.Tensor:
    """The package's form: ``proj_out([attn | gelu(proj_mlp(x))])`` through one buffer (diffusers' bits)."""
    from torchpatches.ops import _slices as slices

    mlp = torch.nn.functional.linear(x, w_mlp, b_mlp)
    buf = mlp.new_empty((mlp.shape[0], WIDTH + MLP))
    slices.prechecked(mlp, buf[:, WIDTH:], gelu=True)
    slices.prechecked(attn, buf[:, :WIDTH], gelu=False)
    return torch.nn.functional.linear(buf, w_out, b_out)


def split_tail(x: torch.Tensor, attn: torch.Tensor, w_mlp: torch.Tensor, b_mlp: torch.Tensor, w_out: torch.Tensor,
               b_out: torch.Tensor) -> torch.Tensor:
    """GELU in the epilogue, ``proj_out`` as two accumulating GEMMs over the halves of its weight."""
    gelu = torch._addmm_activation(b_mlp, x, w_mlp.t(), use_gelu=True)
    out = torch.addmm(b_out, attn, w_out[:, :WIDTH].t())
    return out.addmm_(gelu, w_out[:, WIDTH:].t())


def strided_tail(x: torch.Tensor, attn: torch.Tensor, w_mlp: torch.Tensor, b_mlp: torch.Tensor, w_out: torch.Tensor,
                 b_out: torch.Tensor) -> torch.Tensor:
    """GELU in the epilogue, written into the buffer's right half; the attention output copied as today."""
    from torchpatches.ops import _slices as slices

    buf = x.new_empty((x.shape[0], WIDTH + MLP))
    torch._addmm_activation(b_mlp, x, w_mlp.t(), use_gelu=True, out=buf[:, WIDTH:])
    slices.prechecked(attn, buf[:, :WIDTH], gelu=False)
    return torch.nn.functional.linear(buf, w_out, b_out)


TAILS: Dict[str, Callable[..., torch.Tensor]] = {"buffer": buffer_tail, "split": split_tail, "strided": strided_tail}


def reference(x: torch.Tensor, attn: torch.Tensor, w_mlp: torch.Tensor, b_mlp: torch.Tensor, w_out: torch.Tensor,
              b_out: torch.Tensor) -> torch.Tensor:
    """float64, no rounding between the ops."""
    d = [t.double() for t in (x, attn, w_mlp, b_mlp, w_out, b_out)]
    gelu = torch.nn.functional.gelu(d[0] @ d[2].t() + d[3], approximate="tanh")
    return torch.cat([d[1], gelu], -1) @ d[4].t() + d[5]


def kernels_of(fn: Callable[[], Any]) -> List[str]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


def op_part(reps: int, rounds: int) -> Dict[str, Any]:
    device, dtype = torch.device("cuda"), torch.bfloat16
    gen = torch.Generator(device).manual_seed(0)
    x = torch.randn(M, WIDTH, device=device, dtype=dtype, generator=gen)
    attn = torch.randn(M, WIDTH, device=device, dtype=dtype, generator=gen)
    w_mlp = (torch.randn(MLP, WIDTH, device=device, generator=gen) * WIDTH ** -0.5).to(dtype)
    b_mlp = torch.randn(MLP, device=device, dtype=dtype, generator=gen) * 0.1
    w_out = (torch.randn(WIDTH, WIDTH + MLP, device=device, generator=gen) * (WIDTH + MLP) ** -0.5).to(dtype)
    b_out = torch.randn(WIDTH, device=device, dtype=dtype, generator=gen) * 0.1
    args = (x, attn, w_mlp, b_mlp, w_out, b_out)
    ref = reference(*args)
    outs = {name: TAILS[name](*args) for name in FORMS}
    # ulps at the first half's partial sum too: the rounding split adds is there, and the output may cancel it
    partial = torch.addmm(b_out, attn, w_out[:, :WIDTH].t())
    rows: Dict[str, Dict[str, Any]] = {}
    for name in FORMS:
        against_buffer = compare(outs[name], outs["buffer"], partial)
        rows[name] = dict(kernels=kernels_of(lambda: TAILS[name](*args)),
                          identical_to_buffer=against_buffer["identical_frac"],
                          max_ulp_vs_buffer=against_buffer["max_ulp"],
                          rel_err_vs_float64=float((outs[name].double() - ref).norm() / ref.norm()),
                          us=[])
    for _ in range(3):
        for name in FORMS:
            TAILS[name](*args)
    for _ in range(rounds):
        for name in FORMS:
            rows[name]["us"].append(_bench.time_back_to_back(lambda: TAILS[name](*args), reps, 1)[0] * 1e3)
    flops = 2 * M * WIDTH * MLP + 2 * M * (WIDTH + MLP) * WIDTH
    print(f"one FLUX.1-dev single block's tail (M = {M}): GPU us (median of {rounds} rounds x {reps}), TFLOP/s of "
          f"the two GEMMs, output vs the buffer form and vs float64")
    for name, row in rows.items():
        row["median_us"] = statistics.median(row["us"])
        row["tflops"] = flops / row["median_us"] / 1e6
        print(f"  {name:<8} {row['median_us']:8.1f} us {row['tflops']:6.0f} TFLOP/s  identical "
              f"{row['identical_to_buffer']:.6f}  max {row['max_ulp_vs_buffer']:.1f} ulp  rel err vs float64 "
              f"{row['rel_err_vs_float64']:.3e}  kernels: {', '.join(k[:60] for k in row['kernels'])}", flush=True)
    return rows


# ---- part 2: the forms in the whole model (``_bench.state("single:NAME")``) -----------------------------------


def _fits(hidden_states: torch.Tensor, joint_attention_kwargs: Any) -> bool:
    return hidden_states.device.type == "cuda" and hidden_states.dtype == torch.bfloat16 and not joint_attention_kwargs


def _single(form: str, patched: Callable[..., Any]) -> Callable[..., Any]:
    """FLUX.1's single-block forward with its tail in ``form``; the patched forward where it does not fit."""
    from torchpatches.patches import gate_residual

    def forward(self: Any, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor, temb: torch.Tensor,
                image_rotary_emb: Any = None, joint_attention_kwargs: Any = None) -> Any:
        if not _fits(hidden_states, joint_attention_kwargs):
            return patched(self, hidden_states, encoder_hidden_states, temb, image_rotary_emb, joint_attention_kwargs)
        text_seq_len = encoder_hidden_states.shape[1]
        hidden_states = gate_residual.joined(encoder_hidden_states, hidden_states)
        norm_hidden_states, gate = self.norm(hidden_states, emb=temb)
        attn_output = gate_residual._attention(self.attn, (gate_residual._FLUX, "FluxAttention"), None,
                                               (norm_hidden_states, None, None, image_rotary_emb),
                                               hidden_states=norm_hidden_states, image_rotary_emb=image_rotary_emb)
        rows = hidden_states.shape[0] * hidden_states.shape[1]
        tail = TAILS[form](norm_hidden_states.reshape(rows, -1), attn_output.reshape(rows, -1),
                           self.proj_mlp.weight, self.proj_mlp.bias, self.proj_out.weight, self.proj_out.bias)
        hidden_states = gate_residual.residual(hidden_states, gate, tail.view(hidden_states.shape), clip=True)
        return hidden_states[:, :text_seq_len], hidden_states[:, text_seq_len:]

    return forward


@contextlib.contextmanager
def variant(form: str) -> Iterator[None]:
    """Every patch applied (the caller's state), FLUX.1's single blocks computing their tail in ``form``."""
    if form not in ("split", "strided"):
        raise ValueError(f"unknown single-block form {form!r}; expected split or strided")
    from diffusers.models.transformers import transformer_flux

    cls = transformer_flux.FluxSingleTransformerBlock
    patched = cls.forward
    cls.forward = _single(form, patched)
    try:
        yield
    finally:
        cls.forward = patched


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    import torchpatches  # noqa: F401  (the ops' Triton tier)

    results: Dict[str, Any] = {"versions": _bench.versions(), "command": _bench.command_line(argv)}
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    results["ops"] = op_part(args.reps, args.rounds)
    _bench.save_json(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
