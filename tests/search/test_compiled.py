"""``ck.compile`` on the CPU: the callable has the module's signature, binds its parameters
and buffers by name (in-place updates reach the next call), prepares one capture per new
input signature and none for a signature seen before, and ``dynamic`` prepares ahead. On
CPU tensors a call evaluates the captured graph (float64 reference), so every check below
compares against the module itself."""

from __future__ import annotations

import logging
import math
import re

import pytest

import cherenkov as ck

torch = pytest.importorskip("torch")


class Block(torch.nn.Module):
    """A LayerNorm, a linear layer with bias, GELU and a residual; a buffer scales the output."""

    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(dim)
        self.proj = torch.nn.Linear(dim, dim)
        self.register_buffer("gain", torch.full((dim,), 0.5))

    def forward(self, x):
        return x + torch.nn.functional.gelu(self.proj(self.norm(x))) * self.gain


def close(a, b) -> bool:
    return torch.allclose(a.double(), b.double(), rtol=1e-4, atol=1e-5)


@pytest.fixture
def block():
    torch.manual_seed(0)
    return Block().eval()


def test_the_compiled_module_matches_it(block):
    x = torch.randn(4, 16)
    compiled = ck.compile(block, x)
    assert isinstance(compiled, ck.CompiledFunction) and compiled.searches == 1
    assert close(compiled(x), block(x))
    sources = next(iter(compiled.prepared.values())).graph.captured_sources
    assert sources["x"] == "arg:0" and sources["proj_weight"] == "proj.weight" and sources["gain"] == "gain"


def test_in_place_updates_of_parameters_and_buffers_reach_the_next_call(block):
    x = torch.randn(4, 16)
    compiled = ck.compile(block, x)
    before = compiled(x)
    with torch.no_grad():
        block.proj.weight.mul_(-2.0)
        block.gain.fill_(3.0)
    after = compiled(x)
    assert close(after, block(x)) and not close(after, before)
    block.load_state_dict({k: v * 0.5 for k, v in block.state_dict().items()})
    assert close(compiled(x), block(x))
    assert compiled.searches == 1, "updates are bound, not captured again"


def test_one_capture_per_new_signature_and_none_for_one_seen_before(block):
    compiled = ck.compile(block, torch.randn(4, 16))
    compiled(torch.randn(4, 16))
    assert compiled.searches == 1
    x8 = torch.randn(8, 16)
    assert close(compiled(x8), block(x8)) and compiled.searches == 2
    compiled(torch.randn(8, 16))
    compiled(torch.randn(4, 16))
    assert compiled.searches == 2
    compiled(torch.randn(4, 16, dtype=torch.float64).float())
    assert compiled.searches == 2
    compiled(torch.randn(4, 16).bfloat16())
    assert compiled.searches == 3, "a new dtype is a new signature"


def test_a_new_signature_is_logged_by_what_changed_and_a_growing_shape_gets_a_hint(block, caplog):
    compiled = ck.compile(block, torch.randn(4, 16))
    with caplog.at_level(logging.WARNING, logger="cherenkov.search.compiled"):
        for rows in (5, 6, 7):
            compiled(torch.randn(rows, 16))
    said = [r.getMessage() for r in caplog.records if "new signature" in r.getMessage()]
    assert len(said) == 3 and "input 0 (5, 16) float32, was (4, 16) float32; 1 prepared" in said[0], said
    assert "input 0 (7, 16) float32, was (6, 16) float32; 3 prepared" in said[2]
    assert ["growing KV cache" in s for s in said] == [False, False, True], "the hint once, at the fourth signature"


def test_dynamic_buckets_are_prepared_ahead(block):
    compiled = ck.compile(block, torch.randn(4, 16), dynamic=[((2, 16),), ((3, 5, 16),)])
    assert compiled.searches == 3
    x = torch.randn(3, 5, 16)
    assert close(compiled(x), block(x)) and compiled.searches == 3


def test_a_function_with_several_outputs_returns_a_tuple():
    def split_softmax(a, b):
        return torch.softmax(a @ b, dim=-1), (a @ b).sum(-1)

    a, b = torch.randn(3, 4), torch.randn(4, 5)
    compiled = ck.compile(split_softmax, a, b)
    first, second = compiled(a, b)
    expected = split_softmax(a, b)
    assert close(first, expected[0]) and close(second, expected[1])


def test_a_scalar_output_keeps_its_zero_dimensions():
    """A 0-d output is 0-d (the op's fake implementation says so; inductor asserts it)."""

    def total(a):
        return a.sum(), a * 2.0

    a = torch.randn(3, 4)
    scalar, doubled = ck.compile(total, a)(a)
    assert scalar.shape == () and close(scalar, a.sum()) and doubled.shape == (3, 4)


def test_the_cpu_path_says_so_once(block, caplog):
    compiled = ck.compile(block, torch.randn(4, 16))
    with caplog.at_level(logging.WARNING, logger="cherenkov.search.compiled"):
        compiled(torch.randn(4, 16))
        compiled(torch.randn(4, 16))
    assert sum("float64 reference" in r.getMessage() for r in caplog.records) == 1


def test_bad_calls_are_graph_errors(block):
    compiled = ck.compile(block, torch.randn(4, 16))
    with pytest.raises(ck.GraphError, match="tensors only"):
        compiled([1.0] * 16)
    with pytest.raises(ck.GraphError, match="dynamic signature"):
        ck.compile(block, torch.randn(4, 16), dynamic=[((2, 16), (2, 16))])
    with pytest.raises(ck.GraphError, match="nn.Module or a function"):
        ck.compile(3)


def test_a_compiled_function_is_one_named_custom_op_in_profiles(block):
    compiled = ck.compile(block, torch.randn(4, 16))
    assert str(compiled.op).startswith("cherenkov.block_")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        compiled(torch.randn(4, 16))
    names = [event.key for event in profile.key_averages()]
    assert f"cherenkov::{compiled.op._opname}" in names, names


def test_fullgraph_compilation_traces_through_a_compiled_function(block):
    compiled = ck.compile(block, torch.randn(4, 16))
    doubled = torch.compile(lambda x: compiled(x) * 2.0, fullgraph=True, backend="eager", dynamic=False)
    x = torch.randn(4, 16)
    with torch.no_grad():
        assert close(doubled(x), block(x) * 2.0)
    # traced with symbolic sizes (dynamic=True): each is specialised to its value, so the prepared signature serves
    dynamic = torch.compile(lambda x: compiled(x) * 2.0, fullgraph=True, backend="eager", dynamic=True)
    with torch.no_grad():
        assert close(dynamic(x), block(x) * 2.0)
    # the fake implementation refuses a signature it has not prepared (asked directly: a failed Dynamo
    # compile leaves CPython's frame-evaluation hook behind, which lowers the process's recursion depth)
    with pytest.raises(ck.GraphError, match="has not prepared"):
        compiled.output_specs([torch.randn(3, 16)])


def test_op_names_keep_only_safe_characters():
    from cherenkov.search.torch_ops import op_name

    first, second = op_name("Block; DROP TABLE/../x"), op_name("Block; DROP TABLE/../x")
    assert re.fullmatch(r"[a-z0-9_]+", first) and first != second
    assert op_name("7up")[0].isalpha() and op_name("???").startswith("function_")


class _Recording:
    """A stand-in for ``OptimizeResult`` on CPU tensors: ``y = x + w``, run or replayed; with
    ``fresh`` the replay's last kernel writes ``y`` into a new tensor each call (as
    :meth:`~cherenkov.OptimizeResult.capture_fresh` does), else into the recorded one."""

    def __init__(self, fresh: bool = False):
        self.runs = self.captures = 0
        self.fresh = fresh

    def run(self, **inputs):
        self.runs += 1
        return {"y": inputs["x"] + inputs["w"]}

    def capture_fresh(self, **inputs):
        self.captures += 1
        fresh = ("y",) if self.fresh else ()

        class Replay:
            def __init__(self):
                self.inputs, self.fresh, self.recorded = dict(inputs), fresh, inputs["x"] + inputs["w"]

            def __call__(self):
                if self.fresh:
                    return {"y": self.inputs["x"] + self.inputs["w"]}
                torch.add(self.inputs["x"], self.inputs["w"], out=self.recorded)
                return {"y": self.recorded}

        return Replay()


@pytest.mark.parametrize("fresh", [False, True])
def test_a_replays_outputs_are_the_calls_own_copied_only_when_recorded(fresh):
    """Each call's outputs are its own: a recorded output buffer (the replay writes it again
    next call) is copied, one the tail kernels wrote into a new tensor is handed over as is."""
    torch = pytest.importorskip("torch")
    from cherenkov.search.compiled import PreparedCall

    result = _Recording(fresh)
    call = PreparedCall(graph=ck.Graph("replayed"), result=result)
    w, x = torch.ones(4), torch.randn(4)
    outputs = [call.launch({"x": x, "w": w}, cuda_graphs=True)["y"] for _ in range(3)]
    assert result.captures == 1 and all(torch.equal(y, x + w) for y in outputs)
    assert (outputs[-1] is call.replay.recorded) is False
    assert len({y.data_ptr() for y in outputs}) == 3, "no call's output is another's"


def test_a_replay_reads_stable_inputs_in_place_and_copies_the_moving_ones():
    """The second call records; an input at a new address each call (an activation) is copied
    into the recording's buffer, a parameter that kept its address is read in place; a call
    whose parameter moved runs the kernels one by one, and the same move seen twice records
    again, at most ``MAX_RECORDINGS`` times."""
    torch = pytest.importorskip("torch")
    from cherenkov.search.compiled import MAX_RECORDINGS, PreparedCall

    result = _Recording()
    call = PreparedCall(graph=ck.Graph("replayed"), result=result)
    w = torch.ones(4)

    def check(w_now):
        x = torch.randn(4)  # a new tensor, at a new address, every call
        assert torch.equal(call.launch({"x": x, "w": w_now}, cuda_graphs=True)["y"], x + w_now)

    check(w)
    assert (result.runs, result.captures) == (1, 0)
    check(w)
    assert result.captures == 1 and call.stable == ("w",), "the parameter is read in place, x copied in"
    for _ in range(3):
        check(w)
    assert (result.runs, result.captures) == (1, 1)
    w.add_(1.0)  # an in-place update: the replay sees it
    check(w)
    moved = torch.full((4,), 3.0)
    check(moved)
    assert result.runs == 2, "a moved parameter runs the kernels"
    check(moved)
    assert result.captures == 2 and call.replay_addresses == (moved.data_ptr(),)
    for _ in range(4 * MAX_RECORDINGS):
        check(torch.full((4,), 5.0))
    assert result.captures == MAX_RECORDINGS



def test_a_small_input_that_kept_its_address_and_then_moves_is_copied_in_from_then_on():
    """An activation the caller's allocator happened to hand over at one address for the
    first two calls is read in place by the first recording; when it moves, the replay is
    recorded again at once with it copied in, and later calls replay (no kernel-by-kernel run)."""
    torch = pytest.importorskip("torch")
    from cherenkov.search.compiled import PreparedCall

    result = _Recording()
    call = PreparedCall(graph=ck.Graph("replayed"), result=result)
    w, x = torch.ones(4, 16), torch.randn(16)  # x: a fifth of the inputs' bytes
    for _ in range(2):
        assert torch.equal(call.launch({"x": x, "w": w}, cuda_graphs=True)["y"], x + w)
    assert result.captures == 1 and set(call.stable) == {"x", "w"}
    for _ in range(3):
        fresh = torch.randn(16)
        assert torch.equal(call.launch({"x": fresh, "w": w}, cuda_graphs=True)["y"], fresh + w)
    assert (result.captures, call.stable, result.runs) == (2, ("w",), 1)


@pytest.mark.gpu
def test_gpu_compiled_module_runs_its_searched_kernels_and_sees_updates(tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    from cherenkov.search.database import TuningDatabase

    torch.manual_seed(0)
    block = Block(256).cuda().bfloat16().eval()
    x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16)
    with TuningDatabase(tmp_path / "tuning.sqlite") as db:
        compiled = ck.compile(block, x, budget_s=30.0, database=db, out=tmp_path / "run")
        call = next(iter(compiled.prepared.values()))
        assert call.result is not None and call.result.environment.measured

        def error() -> float:
            expected = block(x).float()
            return float((compiled(x).float() - expected).norm() / expected.norm())

        assert error() <= 2e-2
        with torch.no_grad():
            block.proj.weight.mul_(-1.0)
        assert error() <= 2e-2 and compiled.searches == 1
        assert error() <= 2e-2 and call.replay is not None, "the second call on the same tensors records a CUDA graph"
        with torch.no_grad():
            block.proj.weight.mul_(-1.0)  # in place: the replay reads the same parameter
        assert error() <= 2e-2
        fresh = torch.randn_like(x)  # x moved, a small input beside the weights: copied in from now on
        with torch.no_grad():
            expected = block(fresh).float()
        for _ in range(3):
            assert float((compiled(fresh).float() - expected).norm() / expected.norm()) <= 2e-2
        assert call.recordings == 2 and "x" not in call.stable
        # the output-writing kernel runs after the replay into a new tensor: outputs are not shared
        first, second = compiled(x), compiled(fresh)
        assert call.replay.fresh and first.data_ptr() != second.data_ptr()
        with torch.no_grad():
            expected = block(x).float()
        assert float((first.float() - expected).norm() / expected.norm()) <= 2e-2
        with torch.profiler.profile() as profile:
            compiled(x)
        assert f"cherenkov::{compiled.op._opname}" in [event.key for event in profile.key_averages()]
        doubled = torch.compile(lambda a: compiled(a) * 2.0, fullgraph=True, dynamic=False)
        replayed = torch.compile(lambda a: compiled(a) * 2.0, fullgraph=True, dynamic=False, mode="reduce-overhead")
        with torch.no_grad():
            expected = block(x).float() * 2.0
            for fn in (doubled, replayed, replayed, replayed):  # inductor; inside torch's CUDA graphs
                assert float((fn(x).float() - expected).norm() / expected.norm()) <= 2e-2


def test_gradients_reach_the_arguments_and_the_parameters(block):
    """``loss.backward()`` through a compiled module: the backward is ``ck.grad`` of the captured
    graph (here its float64 reference on the CPU), and matches eager autograd for the input
    and every parameter."""
    x = torch.randn(4, 16, requires_grad=True)
    compiled = ck.compile(block, x.detach())
    (compiled(x) ** 2).sum().backward()
    got = {"x": x.grad.clone(), **{n: p.grad.clone() for n, p in block.named_parameters()}}
    x.grad = None
    block.zero_grad()
    (block(x) ** 2).sum().backward()
    expected = {"x": x.grad, **{n: p.grad for n, p in block.named_parameters()}}
    for name, value in expected.items():
        assert torch.allclose(got[name], value, rtol=1e-4, atol=1e-5), name
    call = next(iter(compiled.prepared.values()))
    assert len(call.backward) == 1 and compiled.searches == 1, "one gradient graph, no new capture"


def test_a_training_loop_through_a_compiled_module_follows_eager(block):
    """Three SGD steps of the compiled module and of a copy run eagerly give the same losses
    (the parameters are updated in place; the compiled function reads them by name)."""
    import copy

    eager = copy.deepcopy(block)
    x, target = torch.randn(8, 16), torch.randn(8, 16)
    compiled = ck.compile(block, x)
    losses = {"compiled": [], "eager": []}
    for model, key in ((compiled, "compiled"), (eager, "eager")):
        parameters = block.parameters() if key == "compiled" else eager.parameters()
        optimiser = torch.optim.SGD(parameters, lr=0.1)
        for _ in range(3):
            optimiser.zero_grad()
            loss = ((model(x) - target) ** 2).mean()
            loss.backward()
            optimiser.step()
            losses[key].append(float(loss))
    assert all(math.isclose(a, b, rel_tol=1e-5) for a, b in zip(losses["compiled"], losses["eager"])), losses
    assert losses["eager"][-1] < losses["eager"][0]


class SelfAttention(torch.nn.Module):
    """A fused QKV projection, causal attention over 2 heads (SDPA, or ``spelled_out``: masked
    scores, softmax and a product with v, as nanoGPT writes it), an output projection."""

    def __init__(self, dim: int = 16, heads: int = 2, spelled_out: bool = False) -> None:
        super().__init__()
        self.heads, self.spelled_out = heads, spelled_out
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.out = torch.nn.Linear(dim, dim)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=-1)
        q, k, v = (t.view(b, s, self.heads, d // self.heads).transpose(1, 2) for t in (q, k, v))
        if self.spelled_out:
            scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(d // self.heads))
            mask = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
            y = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1) @ v
        else:
            y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, s, d))


@pytest.mark.parametrize("spelled_out", [False, True], ids=["sdpa", "spelled_out"])
def test_a_training_call_saves_the_attention_statistics_for_its_backward(spelled_out: bool):
    """With gradients wanted, a module's attention (SDPA's, or softmax(scores) @ v written out) runs
    in a training forward that also outputs its output and rows' log-sum-exp (one flash kernel writes
    both); the gradient graph takes them as saved inputs, and every gradient matches eager autograd."""
    torch.manual_seed(0)
    module = SelfAttention(spelled_out=spelled_out)
    x = torch.randn(2, 8, 16, requires_grad=True)
    compiled = ck.compile(module, x.detach(), saved_statistics=True)
    (compiled(x) ** 2).sum().backward()
    got = {"x": x.grad.clone(), **{n: p.grad.clone() for n, p in module.named_parameters()}}
    x.grad = None
    module.zero_grad()
    (module(x) ** 2).sum().backward()
    for name, value in {"x": x.grad, **{n: p.grad for n, p in module.named_parameters()}}.items():
        assert torch.allclose(got[name], value, rtol=1e-4, atol=1e-5), name
    call = next(iter(compiled.prepared.values()))
    training = call.training
    assert training and len(training.saved) == 2 and all(n.startswith("ck_saved_") for n in training.saved)
    (backward,) = call.backward.values()
    assert set(backward.graph.saved) == set(training.saved)
    forward = ck.derive(training.call.graph)
    flash = [k for k in forward.kernels if k.kind == "flash_attention"]
    assert len(flash) == 1 and [s.output for s in flash[0].side_outputs] == [training.saved[1]]
