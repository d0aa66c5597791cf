"""On a GPU, proposals and verifies replayed from CUDA graphs equal the same steps run eagerly.

Greedy, sampled and top-k/top-p batches, with rows gathered and with a batch's rows read as views of its block of
cache rows; compiled steps equal uncompiled ones.

Also on the last GPU of a machine with several, which is not the current device: graphs must still be captured there.
Skipped without CUDA. Also runs as a script on the GPU machine (`python tests/test_cuda_graphs.py`), which may lack
pytest.
"""

from __future__ import annotations

import os
import traceback

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from draft_service.proposer import Proposer
from minedraft.engine.model_runner import ModelRunner, Step, StepBody
from minedraft.engine.sampling import SamplingConfig
from target_service.verifier import Verifier

CONFIGS = {
    "greedy": SamplingConfig(max_tokens=1000),
    "sampled": SamplingConfig(temperature=0.8, seed=3, max_tokens=1000),
    "filtered": SamplingConfig(temperature=1.2, top_k=20, top_p=0.9, seed=5, max_tokens=1000),
}


# `MINEDRAFT_TEST_DETERMINISTIC=1` (`gpu_run.sh deterministic`): every runner here with `--deterministic`.
DETERMINISTIC = os.environ.get("MINEDRAFT_TEST_DETERMINISTIC") == "1"
DEVICES = sorted({"cuda:0", f"cuda:{torch.cuda.device_count() - 1}"}) if torch.cuda.is_available() else ["cuda:0"]


# Rows gathered where prefill put them, then moved into batch 1's block of cache rows and read as views (in another
# order the next time), then gathered from there.
STEPS = [(None, [1, 2, 3]), (1, [1, 2, 3]), (1, [3, 1, 2]), (None, [2, 3, 1])]
SEQS = [1, 2, 3]
PROMPTS = [[(7 * s + j) % 500 for j in range(10 + 5 * s)] for s in SEQS]


def _model(device: str, seed: int) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    return AutoModelForCausalLM.from_config(config).to(device, dtype).eval()


def _proposals(graphs: bool, kind: str, device: str) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    proposer = Proposer(ModelRunner(_model(device, 0), 8, 256, cuda_graphs=graphs, deterministic=DETERMINISTIC))
    proposer.prefill(SEQS, PROMPTS, [CONFIGS[kind]] * len(SEQS))
    accepted, last = torch.zeros(3, dtype=torch.long), torch.tensor([5, 6, 7])
    out = []
    for step, (batch_id, order) in enumerate(STEPS):
        index, back = [SEQS.index(s) for s in order], [order.index(s) for s in SEQS]
        proposal = proposer.propose(order, accepted[index], last[index], 4, batch_id=batch_id)
        probs = None if proposal.draft_probs is None else proposal.draft_probs.cpu()[back]
        out.append((proposal.draft_ids.cpu()[back], probs))
        accepted, last = torch.full((3,), step % 5), out[-1][0][:, 0]
    assert not graphs or proposer.runner.graphs is not None, "a capture failed: the proposals ran eagerly"
    assert not graphs or _chained(proposer.runner)
    return out


def _verifies(
    graphs: bool, kind: str, device: str, compiled: bool | None = None
) -> list[list[tuple[list[int], int, int]]]:
    """Verifies (acceptance and commit in the step's graph) of fixed drafts: ids only when greedy, with a draft's
    probabilities otherwise. `compiled` (True or False): a float32 model, its layers and acceptance compiled or not."""
    model = _model(device, 1) if compiled is None else _model(device, 1).float()
    verifier = Verifier(
        ModelRunner(model, 8, 256, cuda_graphs=graphs, compile_layers=bool(compiled), deterministic=DETERMINISTIC), [0]
    )
    configs = [CONFIGS[kind]] * len(SEQS)
    out = [verifier.prefill(SEQS, PROMPTS, configs).per_row()]
    generator = torch.Generator().manual_seed(2)
    for batch_id, order in STEPS:
        drafts = torch.randint(0, 512, (3, 4), generator=generator)
        probs = None if kind == "greedy" else torch.rand(3, 4, 512, generator=generator).softmax(-1)
        rows = verifier.verify(order, drafts, probs, batch_id).per_row()
        out.append([rows[order.index(s)] for s in SEQS])
    assert not graphs or verifier.runner.graphs is not None, "a capture failed: the verifies ran eagerly"
    assert not graphs or _chained(verifier.runner)
    return out


def _chained(runner: ModelRunner) -> bool:
    """Whether every step was captured as a chain of graphs, a new one at layer calls 1, 3, 7... (so what is compared
    with eager ran across graphs: 2 for a verify of the two-layer models, 4 for a proposal of 4 steps)."""
    assert runner.graphs is not None
    chains = [len(graphs) for graphs, _, _ in runner.graphs.graphs.values()]
    return bool(chains) and min(chains) > 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", list(CONFIGS))
def test_graph_proposals_equal_eager_ones(kind: str, device: str) -> None:
    replayed, eager = _proposals(True, kind, device), _proposals(False, kind, device)
    for (ids, probs), (ids_e, probs_e) in zip(replayed, eager):
        assert torch.equal(ids, ids_e)
        assert (probs is None) == (probs_e is None) == (kind == "greedy")
        assert probs is None or (probs_e is not None and torch.equal(probs, probs_e))


class _HostCopies(TorchDispatchMode):
    """Records tensors made from Python values (`lift_fresh`): on a GPU each is a copy from the host, which a CUDA
    graph capture refuses (the runner then falls back to eager steps)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func is torch.ops.aten.lift_fresh.default:
            self.seen.append("".join(traceback.format_stack(limit=6)[:-2]))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("kind", list(CONFIGS))
def test_what_runs_in_a_graph_copies_nothing_from_the_host(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """On the CPU: the functions a GPU captures (verify and proposal steps, their acceptance, commit, reconcile and
    sampling) make no tensor from a Python value."""
    copies = _HostCopies()
    launch = ModelRunner._launch

    def watched(self: ModelRunner, step: Step, body: StepBody, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        def in_graph(*args):  # type: ignore[no-untyped-def]
            with copies:
                return body(*args)

        return launch(self, step, in_graph if step.graphable else body, inputs)

    monkeypatch.setattr(ModelRunner, "_launch", watched)
    _proposals(False, kind, "cpu")
    _verifies(False, kind, "cpu")
    assert not copies.seen, "made from a Python value inside a graph:\n" + copies.seen[0]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", list(CONFIGS))
def test_graph_verifies_equal_eager_ones(kind: str, device: str) -> None:
    replayed, eager = _verifies(True, kind, device), _verifies(False, kind, device)
    assert replayed == eager
    # Random drafts: a sampled row accepts some of them (its q is not the draft it came from, but u * q < p holds).
    assert kind == "greedy" or any(accepted for step in replayed[1:] for _, accepted, _ in step)


def _compiled_steps(compiled: bool) -> list[torch.Tensor]:
    """Logits of a prefill, verify-sized steps and one-token steps, in float32 (so that compiled and eager code agree
    to rounding)."""
    runner = ModelRunner(_model("cuda:0", 0).float(), 8, 256, cuda_graphs=compiled, compile_layers=compiled)
    rows = torch.tensor(runner.allocate(3))
    generator = torch.Generator().manual_seed(4)
    # Each copied at once: a replayed step's logits live in its graph's buffers, which later replays reuse.
    out = [runner.forward(rows, torch.tensor([p[:10] for p in PROMPTS]), torch.full((3,), 10), last_only=True).cpu()]
    for n in (5, 5, 1, 1, 5):
        ids = torch.randint(0, 512, (3, n), generator=generator)
        out.append(runner.forward(rows, ids, torch.full((3,), n)).cpu())
    assert not compiled or runner.graphs is not None, "a capture failed: the steps ran eagerly"
    assert not compiled or _chained(runner)
    return out


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_compiled_steps_equal_uncompiled_ones() -> None:
    """Compiled layers, masks, rotary embedding and norm, replayed from graphs, against the same steps eagerly."""
    for compiled, eager in zip(_compiled_steps(True), _compiled_steps(False), strict=True):
        torch.testing.assert_close(compiled, eager, atol=1e-3, rtol=1e-3)
        assert torch.equal(compiled.argmax(-1), eager.argmax(-1))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kind", ["greedy", "sampled"])
def test_compiled_verifies_equal_uncompiled_ones(kind: str) -> None:
    """The verifier's compiled acceptance and commit (greedy: the argmax operator inside compiled code), replayed
    from graphs, accept and emit what the uncompiled verifier does."""
    assert _verifies(True, kind, "cuda:0", compiled=True) == _verifies(False, kind, "cuda:0", compiled=False)


def _steps_on_changing_rows(graphs: bool) -> list[torch.Tensor]:
    """Logits of one-token steps on rows that repeat, change in place (the same host tensor), shrink into padding,
    come from the device and come back."""
    runner = ModelRunner(_model("cuda:0", 0), 8, 256, cuda_graphs=graphs)
    everyone = torch.tensor(runner.allocate(4))
    prompts = torch.tensor([(PROMPTS * 2)[i][:10] for i in range(4)])
    out = [runner.forward(everyone, prompts, torch.full((4,), 10), last_only=True).cpu()]
    rows = everyone[:3].clone()
    generator = torch.Generator().manual_seed(5)
    for change in ("first", "again", "in place", "fewer", "from the device", "back"):
        if change == "in place":
            rows[0] = everyone[3]
        step_rows = {"fewer": rows[:2], "from the device": rows.cuda()}.get(change, rows)
        ids = torch.randint(0, 512, (len(step_rows), 1), generator=generator)
        out.append(runner.forward(step_rows, ids, torch.ones(len(step_rows), dtype=torch.long)).cpu())
    assert not graphs or runner.graphs is not None, "a capture failed: the steps ran eagerly"
    return out


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_graph_steps_follow_their_rows_as_they_change() -> None:
    """A graph's rows are copied in only when they differ from those it holds (`CudaGraphs`): each replayed step
    equals the eager one, whatever happened to the rows in between."""
    for replayed, eager in zip(_steps_on_changing_rows(True), _steps_on_changing_rows(False), strict=True):
        assert torch.equal(replayed, eager)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_only_graphed_steps_are_padded() -> None:
    """A prefill of 3 prompts runs on 3 rows (never a graph, so padding would only add work); a verify of the same 3
    rows runs padded to the batch bucket of 4, as its graph."""
    model = _model("cuda:0", 1)
    verifier = Verifier(ModelRunner(model, 8, 256), [0])
    batches: list[int] = []
    model.model.embed_tokens.register_forward_hook(lambda module, args, output: batches.append(args[0].shape[0]))
    verifier.prefill(SEQS, PROMPTS, [CONFIGS["greedy"]] * len(SEQS)).per_row()
    assert batches == [3], batches
    verifier.verify(SEQS, torch.zeros(3, 4, dtype=torch.long), None, 1).per_row()
    assert batches[1:] and set(batches[1:]) == {4}, batches


if __name__ == "__main__":
    test_only_graphed_steps_are_padded()
    print("prefills run unpadded, verifies padded")
    test_graph_steps_follow_their_rows_as_they_change()
    print("graph steps follow their rows as they change")
    for name in CONFIGS:
        for where in DEVICES:
            test_graph_proposals_equal_eager_ones(name, where)
            test_graph_verifies_equal_eager_ones(name, where)
            print(f"{name} on {where}: graph proposals and verifies equal eager ones")
    test_compiled_steps_equal_uncompiled_ones()  # (last: the compiles take minutes on a fresh machine)
    print("compiled steps equal uncompiled ones")
    for name in ("greedy", "sampled"):
        test_compiled_verifies_equal_uncompiled_ones(name)
    print("compiled verifies equal uncompiled ones")
