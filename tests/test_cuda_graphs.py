"""torchpatches.cuda_graphs: the opt-in CUDA-graph wrapper.

On the CPU a fake capture backend (``Replaying``: captures by calling the model on the static inputs, replays by
calling it again and writing the result into the static output) stands in for CUDA, so the wrapper's contract is
tested without a GPU: signature keys, invalidation, LRU, refusals, eager fallbacks, pickling. With CUDA
(``TORCHPATCHES_TEST_DEVICE=cuda`` or a visible GPU) the GPU cases capture real graphs of the tiny FLUX.1.
"""
from __future__ import annotations

import gc
import os
import pickle
import re
import warnings
import weakref
from typing import Any, Callable, Tuple

import pytest
import torch
from torch.utils import _pytree as pytree

import torchpatches
from torchpatches.cuda_graphs._capture import CaptureFailed
from harness import build_model, tiny_inputs
from torchpatches.cuda_graphs import Graphed, graphed
from torchpatches.ops import force_tier

CUDA = os.environ.get("TORCHPATCHES_TEST_DEVICE") == "cuda" or torch.cuda.is_available()
gpu = pytest.mark.skipif(not CUDA, reason="needs CUDA (TORCHPATCHES_TEST_DEVICE=cuda)")


class Replaying:
    """A capture backend for CPU tensors: 'replay' reruns the model on the static inputs into the static output."""

    device_type = "cpu"

    def __init__(self, fail: bool = False) -> None:
        self.fail, self.warmups = fail, 0

    def pool(self, device: torch.device) -> Any:
        return ("pool", device)

    def capture(self, run: Callable[[], Any], device: torch.device, pool: Any, warmup: int
                ) -> Tuple[Callable[[], None], Any]:
        for _ in range(warmup):
            run()
            self.warmups += 1
        if self.fail:
            raise CaptureFailed("RuntimeError: operation not permitted when stream is capturing")
        output = run()
        statics = pytree.tree_leaves(output)

        def replay() -> None:
            for static, new in zip(statics, pytree.tree_leaves(run())):
                if isinstance(static, torch.Tensor):
                    static.copy_(new)

        return replay, output


class Net(torch.nn.Module):
    """A small model with the attributes the wrapper watches: a processor, a peft-like adapter state."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)
        self.processor = "plain"
        self.scaling = {"default": 1.0}
        self._active_adapter = "default"

    def forward(self, x: torch.Tensor, scale: float = 1.0, return_dict: bool = False, extra: Any = None) -> Any:
        out = self.proj(x) * scale * self.scaling[self._active_adapter]
        if self.processor != "plain":
            out = out + 1
        return {"sample": out} if return_dict else (out,)


def wrap(model: Any, **options: Any) -> Graphed:
    return Graphed(model, backend=Replaying(), **options)


@pytest.fixture
def net() -> Net:
    torch.manual_seed(0)
    return Net().eval().requires_grad_(False)


# ---- signatures ---------------------------------------------------------------------------------------------


def test_one_graph_per_signature(net: Net) -> None:
    w, x = wrap(net), torch.randn(2, 4)
    with torch.inference_mode():
        for _ in range(3):
            w(x)
        assert w.info()[:3] == (1, 3, 0)
        w(torch.randn(3, 4))                       # shape
        w(torch.randn(4, 2).t())                   # strides
        w(x, scale=0.5)                            # a float by value
        w(x, scale=1)                              # 1 is not 1.0
        w(x, return_dict=True)                     # a bool by value
        w(x, extra={"scale": 1.0})                 # dict contents
        w(x, extra={"scale": 2.0})
        assert w.info().captures == 8
        w(x, scale=0.5), w(x, extra={"scale": 2.0}), w(torch.randn(3, 4))
        assert w.info().captures == 8


def test_float_keys_are_bitwise(net: Net) -> None:
    w, x = wrap(net), torch.randn(2, 4)
    with torch.inference_mode():
        w(x, extra=float("nan")), w(x, extra=float("nan"))
        assert w.info().captures == 1               # nan finds itself
        w(x, extra=-0.0), w(x, extra=0.0)
        assert w.info().captures == 3


def test_outputs_equal_eager_and_follow_inputs(net: Net) -> None:
    w, x = wrap(net), torch.randn(2, 4)
    with torch.inference_mode():
        first = w(x)[0]
        assert torch.equal(first, net(x)[0])
        x.mul_(3)                                  # the same tensor, mutated: the replay reads the new values
        assert torch.equal(w(x)[0], net(x)[0])
        assert torch.equal(w(torch.ones(2, 4))[0], net(torch.ones(2, 4))[0])
        assert not torch.equal(first, w(x)[0])     # clone=True: an earlier result is not overwritten
        out = w(x, return_dict=True)
        assert set(out) == {"sample"} and torch.equal(out["sample"], net(x)[0])


def test_clone_false_returns_the_static_output(net: Net) -> None:
    w = wrap(net, clone=False)
    with torch.inference_mode():
        a = w(torch.zeros(2, 4))[0]
        b = w(torch.ones(2, 4))[0]
        assert a is b and torch.equal(a, net(torch.ones(2, 4))[0])   # overwritten by the next call
        c = wrap(net)(torch.zeros(2, 4))[0]
        assert c is not wrap(net)(torch.zeros(2, 4))[0]


def test_lru_cap(net: Net) -> None:
    w = wrap(net, max_graphs=2)
    with torch.inference_mode():
        for n in (1, 2, 3):
            w(torch.randn(n, 4))
        assert w.info().graphs == 2 and w.info().captures == 3
        w(torch.randn(3, 4))                       # kept
        assert w.info().captures == 3
        w(torch.randn(1, 4))                       # dropped first: captured again
        assert w.info().captures == 4


# ---- invalidation -------------------------------------------------------------------------------------------


def _captures_after(w: Graphed, x: torch.Tensor, change: Callable[[], Any]) -> int:
    with torch.inference_mode():
        w(x)
        before = w.info().captures
        change()
        out = w(x)[0]
        assert torch.equal(out, w.model(x)[0])
        w(x)
        return w.info().captures - before


@pytest.mark.parametrize("change", [
    "param_replaced", "data_assigned", "submodule_replaced", "forward_hook", "pre_hook", "training",
    "instance_forward", "processor", "adapter_scale", "adapter_switch",
])
def test_model_changes_recapture(net: Net, change: str) -> None:
    w, x = wrap(net), torch.randn(2, 4)
    changes = {
        "param_replaced": lambda: setattr(net.proj, "weight", torch.nn.Parameter(torch.ones(4, 4), False)),
        "data_assigned": lambda: setattr(net.proj.weight, "data", torch.full((4, 4), 2.0)),
        "submodule_replaced": lambda: setattr(net, "proj", torch.nn.Linear(4, 4).requires_grad_(False)),
        "forward_hook": lambda: net.proj.register_forward_hook(lambda m, i, o: o * 2),
        "pre_hook": lambda: net.proj.register_forward_pre_hook(lambda m, i: None),
        "training": lambda: net.train(),
        "instance_forward": lambda: setattr(net.proj, "forward", lambda t: t),
        "processor": lambda: setattr(net, "processor", "other"),
        "adapter_scale": lambda: net.scaling.__setitem__("default", 0.5),
        "adapter_switch": lambda: (net.scaling.__setitem__("b", 3.0), setattr(net, "_active_adapter", "b")),
    }
    assert _captures_after(w, x, changes[change]) == 1


class Pair(torch.nn.Module):
    """Two containers of submodules, so a child can move from one to the other with the totals unchanged."""

    def __init__(self) -> None:
        super().__init__()
        self.left, self.right = torch.nn.Sequential(torch.nn.Linear(4, 4)), torch.nn.Sequential()
        self.register_buffer("offset", torch.zeros(4))

    def forward(self, x: torch.Tensor) -> Tuple[torch.Tensor]:
        return (self.right(self.left(x)) + self.offset,)


@pytest.mark.parametrize("change", [
    "child_moved", "children_swapped", "container_replaced", "buffer_replaced", "parameter_to_none",
    "equal_processor", "active_list_mutated",
])
def test_model_changes_by_identity_recapture(change: str) -> None:
    """What ModelWatch compares by identity or by count: a change that keeps every total and every value."""
    model = Pair()
    model.processor, model.scaling, model._active_adapter = ("plain",), {"a": 1.0}, ["a"]
    layer = model.left[0]
    changes = {
        "child_moved": lambda: model.right.append(model.left._modules.pop("0")),
        "children_swapped": lambda: (setattr(model, "left", model.right), setattr(model, "right", model.left)),
        "container_replaced": lambda: setattr(model.left, "_modules", {"0": torch.nn.Linear(4, 4)}),
        "buffer_replaced": lambda: setattr(model, "offset", torch.zeros(4)),
        "parameter_to_none": lambda: setattr(layer, "bias", None),
        "equal_processor": lambda: setattr(model, "processor", tuple(["plain"])),  # equal, another object
        "active_list_mutated": lambda: model._active_adapter.append("b"),
    }
    w, x = wrap(model), torch.randn(2, 4)
    assert _captures_after(w, x, changes[change]) == 1


def test_unchanged_model_keeps_its_graph_after_a_round_trip(net: Net) -> None:
    """Values that come back (a scaling set and restored, a hook added and removed) find the graph again."""
    w, x = wrap(net), torch.randn(2, 4)

    def round_trip() -> None:
        net.scaling["default"] = 0.5
        net.scaling["default"] = 1.0
        net.proj.register_forward_hook(lambda m, i, o: o).remove()
    assert _captures_after(w, x, round_trip) == 0


def test_to_recaptures(net: Net) -> None:
    w, x = wrap(net), torch.randn(2, 4)
    with torch.inference_mode():
        w(x)
        net.double()
        assert torch.equal(w(x.double())[0], net(x.double())[0])
        net.float()                                 # the float32 graph read the old storage: captured again
        assert torch.equal(w(x)[0], net(x)[0]) and w.info().captures == 3


def test_in_place_weight_change_needs_no_capture(net: Net) -> None:
    w, x = wrap(net), torch.randn(2, 4)
    assert _captures_after(w, x, lambda: net.proj.weight.mul_(2)) == 0


def test_hook_removed_recaptures(net: Net) -> None:
    w, x = wrap(net), torch.randn(2, 4)
    handle = net.proj.register_forward_hook(lambda m, i, o: o * 2)
    assert _captures_after(w, x, handle.remove) == 1


def test_reset_and_unwatched_model(net: Net) -> None:
    w, x = wrap(net, watch_model=False), torch.randn(2, 4)
    assert _captures_after(w, x, lambda: net.scaling.__setitem__("default", 0.5)) == 0   # not watched
    with torch.inference_mode():
        w.reset()
        assert w.info().graphs == 0
        w(x)
    assert w.info().captures == 2 and w.info().graphs == 1


def test_global_token_follows_patches_tier_and_modes() -> None:
    import diffusers.models.embeddings  # noqa: F401 - rope's target: the patch applies on its import
    from torchpatches.cuda_graphs._keys import global_token

    base = global_token("cuda")
    assert "rope" in base[0] and global_token("cuda") == base
    with torchpatches.disabled("rope"):
        assert "rope" not in global_token("cuda")[0]
    with force_tier("torch"):
        assert global_token("cuda") != base
    with torch.no_grad():
        assert global_token("cuda") != base
    handle = torch.nn.modules.module.register_module_forward_hook(lambda m, i, o: o)
    try:
        assert global_token("cuda") != base
    finally:
        handle.remove()
    assert global_token("cuda") == base


def test_patch_state_selects_its_own_graph() -> None:
    model, inputs = build_model("flux1-fused"), tiny_inputs("flux1-fused")
    torchpatches.status()  # settles patches still pending on modules diffusers imported meanwhile (sd3_qk_norm)
    was = torchpatches.status()["adaln"].state.value
    torchpatches.apply("adaln")  # what disabling changes: applied here even if a test before reverted it
    try:
        w = wrap(model)
        with force_tier("torch"), torch.inference_mode():
            w(**inputs)
            with torchpatches.disabled("adaln"):
                assert torch.equal(w(**inputs)[0], model(**inputs)[0])
            assert torch.equal(w(**inputs)[0], model(**inputs)[0])
            assert w.info().captures == 2               # back on: the first graph again
            with torchpatches.disabled():
                w(**inputs)
            w(**inputs)
        assert w.info().captures == 3
    finally:
        if was != "applied":
            torchpatches.revert("adaln")


def test_peft_adapters_recapture() -> None:
    peft = pytest.importorskip("peft")
    model, inputs = build_model("flux1-fused"), tiny_inputs("flux1-fused")
    w = wrap(model)

    def captures_now(**extra: Any) -> int:
        with force_tier("torch"), torch.no_grad():
            assert torch.equal(w(**inputs, **extra)[0], model(**inputs, **extra)[0])
        return w.info().captures

    assert captures_now() == 1
    for name in ("a", "b"):
        model.add_adapter(peft.LoraConfig(r=2, lora_alpha=2, target_modules=["to_q", "to_k"], init_lora_weights=False),
                          adapter_name=name)                                    # modules injected
        assert captures_now() == 2 + (name == "b")
    model.set_adapters(["a", "b"], [0.5, 1.0])                                  # active adapters and scaling
    assert captures_now() == 4
    model.set_adapters(["a", "b"], [0.7, 1.0])                                  # scaling alone
    assert captures_now() == 5 and captures_now() == 5
    assert captures_now(joint_attention_kwargs={"scale": 0.5}) == 6            # a scale argument: its own key
    model.disable_adapters()
    assert captures_now() == 7


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=gpu)])
def test_a_flux_pipeline_loop_captures_once_and_replays_every_step(device: str) -> None:
    """``pipe.transformer = graphed(pipe.transformer)``: FluxPipeline's denoising loop (the timestep a tensor,
    guidance, ids) is one signature, so the first step captures and every step replays; the latents equal the
    unwrapped pipeline's bit for bit; ``step.model`` puts the model back, config entry included. On the CPU
    with the test backend, on CUDA with real graphs."""
    pytest.importorskip("transformers", reason="FluxPipeline needs transformers (the peft-accelerate session)")
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline

    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    model = build_model("flux1-fused", dtype=dtype, device=device)
    # The pipeline takes its device from its modules, and the wrapper is not one: a VAE on the device (unused
    # with latent output) keeps the device found; without one the latents would be made on the CPU.
    vae = AutoencoderKL(block_out_channels=(8,) * 4, down_block_types=("DownEncoderBlock2D",) * 4,
                        up_block_types=("UpDecoderBlock2D",) * 4, latent_channels=4, norm_num_groups=8,
                        layers_per_block=1).to(device, dtype)
    pipe = FluxPipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae, text_encoder=None, tokenizer=None,
                        text_encoder_2=None, tokenizer_2=None, transformer=model)
    pipe.set_progress_bar_config(disable=True)
    g = torch.Generator().manual_seed(0)
    embeds = torch.randn(1, 8, 32, generator=g), torch.randn(1, 16, generator=g)
    call = dict(prompt_embeds=embeds[0].to(device, dtype), pooled_prompt_embeds=embeds[1].to(device, dtype),
                height=32, width=32, num_inference_steps=3, guidance_scale=3.5, output_type="latent")
    with torch.inference_mode():
        expected = pipe(**call, generator=torch.Generator().manual_seed(1)).images
        step = pipe.transformer = wrap(model) if device == "cpu" else graphed(model)
        latents = pipe(**call, generator=torch.Generator().manual_seed(1)).images
    assert torch.equal(latents, expected)
    assert step.info() == (1, 3, 0, 1)                  # captures, replays, eager calls, graphs held
    pipe.transformer = step.model
    assert pipe.transformer is model and tuple(pipe.config.transformer) == ("diffusers", "FluxTransformer2DModel")


# ---- what runs eagerly, what is refused ---------------------------------------------------------------------


def test_cpu_inputs_run_eagerly_bit_for_bit() -> None:
    model, inputs = build_model("flux1-fused"), tiny_inputs("flux1-fused")
    w = graphed(model)                              # the CUDA backend: CPU tensors are its eager case
    with torch.inference_mode():
        assert torch.equal(w(**inputs)[0], model(**inputs)[0])
    assert w.info()[:3] == (0, 0, 1)


def test_eager_cases(net: Net) -> None:
    w, x = wrap(lambda *args, **kwargs: None), torch.randn(2, 4)
    with torch.inference_mode():
        w(3.0)                                      # no tensor
        w(torch.randn(2, 4, device="meta"))         # not the backend's device type
        w(x, extra=torch.randn(1, device="meta"))   # two devices
        w(torch.randn(2, 4).to_sparse())            # not strided
    assert w.info()[:3] == (0, 0, 4)


def test_grad_runs_eagerly_warned_once(net: Net) -> None:
    w, x = wrap(net), torch.randn(2, 4, requires_grad=True)
    with pytest.warns(RuntimeWarning, match="autograd would record"):
        out = w(x)[0]
    assert out.grad_fn is not None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        w(x)
        net.proj.weight.requires_grad_(True)
        assert w(x.detach())[0].grad_fn is not None
    net.requires_grad_(False)
    w(x.detach())                                   # grad mode, nothing requires grad: a graph
    assert w.info()[:3] == (1, 1, 3)


def test_failed_capture_warns_once_then_eager(net: Net) -> None:
    w, x = Graphed(net, backend=Replaying(fail=True)), torch.randn(2, 4)
    with torch.inference_mode():
        with pytest.warns(RuntimeWarning, match="could not be captured"):
            assert torch.equal(w(x)[0], net(x)[0])
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert torch.equal(w(x)[0], net(x)[0])
    assert w.info()[:3] == (0, 0, 2) and w._backend.warmups == 2


class AllocatorPools(Replaying):
    """``Replaying`` with the CUDA caching allocator's rule for a graph's private pool: a capture takes the pool (its
    use count + 1, a new pool at 1), a graph gives it back when dropped, a failed capture at once; capturing into a
    pool whose count fell to 0 fails (``TORCH_INTERNAL_ASSERT(it->second->use_count > 0)``). ``failing``: which
    captures (0, 1, ...) fail."""

    def __init__(self, failing: Tuple[int, ...] = ()) -> None:
        super().__init__()
        self.failing, self.attempts, self.pools, self.uses = failing, 0, 0, {}

    def pool(self, device: torch.device) -> Any:
        self.pools += 1
        return ("pool", self.pools)

    def capture(self, run: Callable[[], Any], device: torch.device, pool: Any, warmup: int
                ) -> Tuple[Callable[[], None], Any]:
        gc.collect()  # graphs the wrapper dropped are gone, as CUDAGraph's destructor runs at once
        if self.uses.get(pool, 1) == 0:
            raise CaptureFailed("RuntimeError: it->second->use_count > 0 INTERNAL ASSERT FAILED")
        self.uses[pool] = self.uses.get(pool, 0) + 1
        attempt, self.attempts = self.attempts, self.attempts + 1
        if attempt in self.failing:
            self.uses[pool] -= 1
            raise CaptureFailed("RuntimeError: Cannot copy between CPU and CUDA tensors during CUDA graph capture")
        replay, output = super().capture(run, device, pool, warmup)
        weakref.finalize(replay, self.uses.__setitem__, pool, self.uses[pool] - 1)
        return replay, output


@pytest.mark.parametrize("case", ["first capture failed", "last graph evicted", "reset"])
def test_a_pool_whose_graphs_are_gone_is_not_captured_into_again(net: Net, case: str) -> None:
    """A signature that cannot be captured (or an eviction, a reset) must not cost later signatures their graphs:
    the wrapper takes a new pool once no graph of the old one is held (without that, a QwenImage run on the GPU hit the
    allocator's assert in every capture after one failed)."""
    backend = AllocatorPools(failing={"first capture failed": (0,), "last graph evicted": (1,)}.get(case, ()))
    w = Graphed(net, backend=backend, max_graphs=1)
    with torch.inference_mode(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        w(torch.randn(1, 4))                   # captured, or failed: eager
        w(torch.randn(2, 4))                   # failed (its eager entry evicts the first graph), or captured
        if case == "reset":
            w.reset()
        x = torch.randn(3, 4)
        assert torch.equal(w(x)[0], net(x)[0])
    failed = [str(c.message) for c in caught if "could not be captured" in str(c.message)]
    assert len(failed) == (0 if case == "reset" else 1)
    assert not any("INTERNAL ASSERT" in message for message in failed)
    assert w.info().graphs == 1 and w.info().captures == (3 if case == "reset" else 2)


def test_a_held_graph_keeps_its_pool_shared(net: Net) -> None:
    """While a graph of the pool is held the next signature shares the pool (what the pool is for)."""
    backend = AllocatorPools()
    w = Graphed(net, backend=backend)
    with torch.inference_mode():
        for n in (1, 2, 3):
            w(torch.randn(n, 4))
    assert backend.pools == 1 and backend.uses == {("pool", 1): 3} and w.info().captures == 3


def test_refusals(net: Net) -> None:
    w = wrap(net)
    with pytest.raises(ValueError, match=r"kwargs\['extra'\]\['gen'\] is a torch._C.Generator"):
        w(torch.randn(2, 4), extra={"gen": torch.Generator()})
    for bad in (dict(max_graphs=0), dict(max_graphs=True), dict(warmup=0)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            graphed(net, **bad)
    with pytest.raises(ValueError, match="already a graphed"):
        graphed(graphed(net))
    with pytest.raises(ValueError, match="callable"):
        graphed(3)



@pytest.mark.parametrize("flag", ["clone", "watch_model"])
@pytest.mark.parametrize("bad", ["no", "False", "", 0, 1, None, 1.0])
def test_flags_must_be_bools(net: Net, flag: str, bad: Any) -> None:
    with pytest.raises(ValueError, match=f"{flag} must be a bool, got {re.escape(repr(bad))}"):
        graphed(net, **{flag: bad})
    assert getattr(graphed(net, **{flag: False}), f"_{flag}") is False
    assert getattr(graphed(net, **{flag: True}), f"_{flag}") is True


_UNKEYABLE_CALLS = {  # the same call, the unkeyable argument before and after the tensors, at the top and nested
    "keywords, generator last": lambda w, x, gen: w(x=x, extra={"gen": gen}),
    "keywords, generator first": lambda w, x, gen: w(extra={"gen": gen}, x=x),
    "positional tensor": lambda w, x, gen: w(x, extra={"gen": gen}),
    "dict, tensor first": lambda w, x, gen: w(extra={"t": x, "gen": gen}, x=x),
    "dict, generator first": lambda w, x, gen: w(extra={"gen": gen, "t": x}, x=x),
    "list, tensor first": lambda w, x, gen: w(extra=[x, [gen]], x=x),
    "list, generator first": lambda w, x, gen: w(extra=[[gen], x], x=x),
    "tuple, tensor first": lambda w, x, gen: w(extra=(x, gen), x=x),
    "tuple, generator first": lambda w, x, gen: w(extra=(gen, x), x=x),
}


@pytest.mark.parametrize("order", list(_UNKEYABLE_CALLS))
def test_an_unkeyable_argument_is_refused_whatever_the_order(order: str) -> None:
    """A call with an argument no key can hold raises, also when its tensors would run it eagerly (CPU tensors for
    the CUDA backend, a tensor on the meta device, a sparse tensor, tensors on two devices): keyword order, dict
    order and container nesting do not change the outcome, and the model is not called."""
    calls = []
    model = lambda *args, **kwargs: calls.append(1)  # noqa: E731
    gen, call, meta = torch.Generator(), _UNKEYABLE_CALLS[order], torch.randn(1, device="meta")
    for w, x in ((graphed(model), torch.randn(2, 4)),                 # CPU tensors, the CUDA backend
                 (wrap(model), torch.randn(2, 4, device="meta")),     # not the backend's device type
                 (wrap(model), torch.randn(2, 4).to_sparse()),        # not strided
                 (wrap(model), [torch.randn(2, 4), meta]),            # two devices
                 (wrap(model), torch.randn(2, 4))):                   # keyable tensors
        with pytest.raises(ValueError, match=r"argument kwargs\['extra'\].* is a torch._C.Generator"):
            call(w, x, gen)
        assert w.info()[:3] == (0, 0, 0)
    assert not calls


def test_compiled_wrapper_calls_the_model(net: Net) -> None:
    w, x = wrap(net), torch.randn(2, 4)
    with torch.inference_mode():
        out = torch.compile(w, backend="eager", fullgraph=True)(x)[0]
    assert torch.equal(out, net(x)[0]) and w.info()[:3] == (0, 0, 0)


# ---- a stand-in for the model; pickling and lifetime -------------------------------------------------------


def test_attributes_pickling_and_lifetime() -> None:
    net = Net().eval().requires_grad_(False)
    w, x = wrap(net), torch.randn(2, 4)
    assert w.processor == "plain" and w.model is net
    with torch.inference_mode():
        w(x)
    again = pickle.loads(pickle.dumps(w))
    assert again.info().graphs == 0 and again._clone and isinstance(again.model, Net)
    with torch.inference_mode():
        assert torch.equal(again(x)[0], net(x)[0])
    model_ref, wrapper_ref = weakref.ref(net), weakref.ref(w)
    del w, again, net
    gc.collect()
    assert model_ref() is None and wrapper_ref() is None


# ---- the CUDA backend's calls, against a stand-in torch.cuda ----------------------------------------------------


class _CudaStandIn:
    """Records what ``CudaBackend`` asks of ``torch.cuda``; ``fail`` makes the captured call raise."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        import contextlib

        self.log: list = []
        self.fail = False
        log = self.log

        class Stream:
            def wait_stream(self, other: Any) -> None:
                log.append("wait")

        class Graph:
            def replay(self) -> None:
                log.append("replay")

        @contextlib.contextmanager
        def recorded(what: str, *args: Any, **kwargs: Any) -> Any:
            log.append(what)
            yield
            log.append(f"/{what}")

        for name, value in dict(Stream=Stream, CUDAGraph=Graph, current_stream=Stream, current_device=lambda: 0,
                                synchronize=lambda: log.append("sync"), graph_pool_handle=lambda: "pool",
                                device=lambda d: recorded("device"), stream=lambda s: recorded("side"),
                                graph=lambda g, pool: recorded(f"capture into {pool}")).items():
            monkeypatch.setattr(torch.cuda, name, value)


def test_cuda_backend_warms_up_on_a_side_stream_then_captures(monkeypatch: pytest.MonkeyPatch) -> None:
    from torchpatches.cuda_graphs._capture import CudaBackend

    cuda, backend = _CudaStandIn(monkeypatch), CudaBackend()
    calls = []
    replay, out = backend.capture(lambda: calls.append(list(cuda.log)) or "out", torch.device("cuda", 0),
                                  backend.pool(torch.device("cuda", 0)), 2)
    assert out == "out" and len(calls) == 3
    assert cuda.log == ["device", "/device", "device", "wait", "side", "/side", "wait", "capture into pool",
                        "/capture into pool", "/device"]
    replay()
    assert cuda.log[-1] == "replay"

    def fails() -> None:
        if "capture into pool" in cuda.log and cuda.log[-1] == "capture into pool":
            raise RuntimeError("operation not permitted when stream is capturing")

    with pytest.raises(CaptureFailed, match="not permitted") as info:
        backend.capture(fails, torch.device("cuda", 0), "pool", 1)
    assert isinstance(info.value.__cause__, RuntimeError) and cuda.log[-2:] == ["capture into pool", "sync"]


def test_wrapper_through_the_cuda_backend(monkeypatch: pytest.MonkeyPatch, net: Net) -> None:
    from torchpatches.cuda_graphs._capture import CudaBackend

    class OnCpu(CudaBackend):
        device_type = "cpu"

    cuda, x = _CudaStandIn(monkeypatch), torch.randn(2, 4)
    w = Graphed(net, backend=OnCpu())
    with torch.inference_mode():
        assert torch.equal(w(x)[0], net(x)[0])    # the captured call's output (the stand-in replays nothing)
        w(x)
    assert cuda.log.count("capture into pool") == 1 and cuda.log.count("replay") == 2 and w.info()[:3] == (1, 2, 0)


# ---- on a GPU ------------------------------------------------------------------------------------------------


@gpu
def test_gpu_flux_graphed_equals_eager() -> None:
    model = build_model("flux1-fused", dtype=torch.bfloat16, device="cuda")
    inputs = tiny_inputs("flux1-fused", dtype=torch.bfloat16, device="cuda")
    w = graphed(model)
    with torch.no_grad():  # not inference mode: the test adds a submodule and converts the model inside
        want = model(**inputs)[0]
        assert torch.equal(w(**inputs)[0], want) and torch.equal(w(**inputs)[0], want)
        assert w.info()[:3] == (1, 2, 0)
        inputs["hidden_states"].mul_(0.5)          # replay after input mutation sees the new values
        assert torch.equal(w(**inputs)[0], model(**inputs)[0])
        wider = tiny_inputs("flux1-fused", dtype=torch.bfloat16, device="cuda", side=6)
        assert torch.equal(w(**wider)[0], model(**wider)[0]) and w.info().captures == 2
        handle = model.transformer_blocks[0].register_forward_hook(lambda m, i, o: o)
        assert torch.equal(w(**inputs)[0], model(**inputs)[0]) and w.info().captures == 3
        handle.remove()
        weight = model.proj_out.weight
        weight.data = weight.data.clone()          # the old storage may be freed: must recapture
        assert torch.equal(w(**inputs)[0], model(**inputs)[0]) and w.info().captures == 4
        model.scale_probe = torch.nn.Linear(2, 2)  # a submodule added
        assert torch.equal(w(**inputs)[0], model(**inputs)[0]) and w.info().captures == 5
        model.float().to(torch.bfloat16)           # the same dtype again, in new storage
        assert torch.equal(w(**inputs)[0], model(**inputs)[0]) and w.info().captures == 6
        assert w.info().replays == 8 and w.info().eager_calls == 0


@gpu
@pytest.mark.parametrize("failure", ["host sync", "pageable copy"])
def test_gpu_a_signature_captures_after_another_failed(failure: str) -> None:
    """The CUDA caching allocator asserts when a capture reuses a pool whose graphs are all gone: after one
    signature fails, the next one still gets its graph, and its replays equal eager."""
    class FailsWhenFour(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if x.shape[0] != 4:
                return x * 2
            if failure == "host sync":
                return x * float(x.sum().item())
            return x + torch.ones(4).to(x.device)  # a pageable host copy: refused while capturing

    w = graphed(FailsWhenFour())
    with torch.inference_mode():
        with pytest.warns(RuntimeWarning, match="could not be captured"):
            w(torch.ones(4, device="cuda"))
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            for n in (5, 6):
                x = torch.arange(n, device="cuda", dtype=torch.float32)
                assert torch.equal(w(x), x * 2) and torch.equal(w(x + 1), (x + 1) * 2)
    assert w.info()[:4] == (2, 4, 1, 2)


@gpu
def test_gpu_host_sync_falls_back() -> None:
    class Syncs(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * float(x.sum().item())

    w, x = graphed(Syncs()), torch.ones(4, device="cuda")
    with torch.inference_mode(), pytest.warns(RuntimeWarning, match="could not be captured"):
        assert torch.equal(w(x), x * 4)
    with torch.inference_mode():
        assert torch.equal(w(x * 2), x * 16) and w.info()[:3] == (0, 0, 2)
    # The failed capture leaves the device's random generator usable (torch leaves it in capture mode).
    assert torch.randn(3, device="cuda").shape == (3,)
    torch.cuda.manual_seed(0)
    a = torch.rand(3, device="cuda")
    torch.cuda.manual_seed(0)
    assert torch.equal(torch.rand(3, device="cuda"), a)
