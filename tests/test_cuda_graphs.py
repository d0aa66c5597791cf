"""On a GPU, proposals replayed from CUDA graphs (greedy, sampled, top-k/top-p) equal the same proposals run eagerly,
with rows gathered and with a batch's rows read as views of its block of cache rows.

Also on the last GPU of a machine with several, which is not the current device: graphs must still be captured there.
Skipped without CUDA. Also runs as a script on the GPU machine (`python tests/test_cuda_graphs.py`), which may lack
pytest.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from draft_service.proposer import Proposer
from minedraft.model_runner import ModelRunner
from minedraft.sampling import SamplingConfig

CONFIGS = {
    "greedy": SamplingConfig(max_tokens=1000),
    "sampled": SamplingConfig(temperature=0.8, seed=3, max_tokens=1000),
    "filtered": SamplingConfig(temperature=1.2, top_k=20, top_p=0.9, seed=5, max_tokens=1000),
}


DEVICES = sorted({"cuda:0", f"cuda:{torch.cuda.device_count() - 1}"}) if torch.cuda.is_available() else ["cuda:0"]


def _proposals(graphs: bool, kind: str, device: str) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    config = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(device, torch.bfloat16).eval()
    proposer = Proposer(ModelRunner(model, 8, 256, cuda_graphs=graphs, groups=2))
    seqs = [1, 2, 3]
    prompts = [[(7 * s + j) % 500 for j in range(10 + 5 * s)] for s in seqs]
    proposer.prefill(seqs, prompts, [CONFIGS[kind]] * len(seqs))
    accepted, last = torch.zeros(3, dtype=torch.long), torch.tensor([5, 6, 7])
    out = []
    # Rows gathered where prefill put them, then moved into batch 1's block of cache rows and read as views (in
    # another order the next time), then gathered from there.
    for step, (batch_id, order) in enumerate([(None, [1, 2, 3]), (1, [1, 2, 3]), (1, [3, 1, 2]), (None, [2, 3, 1])]):
        index, back = [seqs.index(s) for s in order], [order.index(s) for s in seqs]
        proposal = proposer.propose(order, accepted[index], last[index], 4, batch_id=batch_id)
        probs = None if proposal.draft_probs is None else proposal.draft_probs.cpu()[back]
        out.append((proposal.draft_ids.cpu()[back], probs))
        accepted, last = torch.full((3,), step % 5), out[-1][0][:, 0]
    return out


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", list(CONFIGS))
def test_graph_proposals_equal_eager_ones(kind: str, device: str) -> None:
    replayed, eager = _proposals(True, kind, device), _proposals(False, kind, device)
    for (ids, probs), (ids_e, probs_e) in zip(replayed, eager):
        assert torch.equal(ids, ids_e)
        assert (probs is None) == (probs_e is None) == (kind == "greedy")
        assert probs is None or torch.equal(probs, probs_e)


if __name__ == "__main__":
    for name in CONFIGS:
        for where in DEVICES:
            test_graph_proposals_equal_eager_ones(name, where)
            print(f"{name} on {where}: graph proposals equal eager ones")
