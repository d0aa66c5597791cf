"""A target sharded over two gloo ranks (real processes) decodes as Hugging Face `generate()` and one rank do."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from stack import server_port
from transformers import PreTrainedModel

from draft_service.proposer import Proposer
from minedraft.engine.model_runner import ModelRunner
from minedraft.engine.models import load_model
from minedraft.engine.sampling import SamplingConfig
from minedraft.engine.tensor_parallel import Progress, TensorParallel, rank_device, shard_model
from minedraft.errors import ModelLoadError
from minedraft.rpc.ranks import HANG_S, Liveness
from minedraft_app.offline import OfflineRequest, generate_offline
from target_service.verifier import Verifier

# Llama and Qwen3 (grouped K/V heads, Qwen3's per-head norms), GPT-NeoX (one fused Q/K/V projection, interleaved by
# head; biases; parallel residual).
ARCHS = ("llama", "qwen3", "gpt_neox")
K = 3
CACHE_LEN = 96
MAX_BATCH = 4

# One rank: its shard of each target, then the drafts-and-verify loop of `generate_offline` over it (the draft whole,
# on every rank, as the draft service would send the same drafts to rank 0 and rank 0 hands them on).
RANK = """
import json, logging, sys, torch
torch.set_num_threads(1)
logging.basicConfig(level=logging.INFO, format="%(message)s")  # (the test checks each rank read its shard alone)
from draft_service.proposer import Proposer
from minedraft_app.offline import OfflineRequest, generate_offline
from minedraft.engine.model_runner import ModelRunner
from minedraft.engine.models import load_model
from minedraft.engine.sampling import SamplingConfig
from minedraft.engine.tensor_parallel import init_group
from target_service.verifier import Verifier
rank, address, spec = int(sys.argv[1]), sys.argv[2], json.loads(sys.argv[3])
tp = init_group(rank, 2, address, torch.device("cpu"))
out = {}
for arch, (target_dir, draft_dir) in spec["models"].items():
    target = load_model(target_dir, dtype="float32", tensor_parallel=tp)
    verifier = Verifier(ModelRunner(target, spec["batch"], spec["cache_len"]), ())
    proposer = Proposer(ModelRunner(load_model(draft_dir, dtype="float32"), spec["batch"], spec["cache_len"]), True)
    requests = [OfflineRequest(p, SamplingConfig(max_tokens=m), arrival_step=i // 2)
                for i, (p, m) in enumerate(spec["prompts"])]
    out[arch] = {
        "tokens": [r.tokens for r in generate_offline(verifier, proposer, requests, spec["k"], spec["batch"])],
        "kv_heads": verifier.runner.cache.kv_heads,
    }
print("RESULT " + json.dumps(out), flush=True)
torch.distributed.barrier()
torch.distributed.destroy_process_group()
import os
os._exit(0)  # (gloo's threads torn down with the interpreter may abort: "terminate called without an active exception")
"""


def _prompts() -> list[tuple[list[int], int]]:
    gen = torch.Generator().manual_seed(42)
    return [(torch.randint(0, 128, (n,), generator=gen).tolist(), m) for n, m in ((3, 12), (17, 20), (30, 8), (9, 16))]


def _offline(target: PreTrainedModel, draft: PreTrainedModel, prompts: list[tuple[list[int], int]]) -> list[list[int]]:
    verifier = Verifier(ModelRunner(target, MAX_BATCH, CACHE_LEN), ())
    proposer = Proposer(ModelRunner(draft, MAX_BATCH, CACHE_LEN), True)
    requests = [
        OfflineRequest(p, SamplingConfig(max_tokens=m), arrival_step=i // 2) for i, (p, m) in enumerate(prompts)
    ]
    return [r.tokens for r in generate_offline(verifier, proposer, requests, K, MAX_BATCH)]


def test_two_ranks_decode_as_hf_and_one_rank(tiny_models, hf_reference, tmp_path: Path) -> None:
    prompts = _prompts()
    models: dict[str, tuple[str, str]] = {}
    for arch in ARCHS:
        target_dir, draft_dir = tmp_path / f"{arch}-target", tmp_path / f"{arch}-draft"
        tiny_models.target(arch).save_pretrained(target_dir)
        tiny_models.noisy_draft(arch).save_pretrained(draft_dir)  # accepts some drafts, rejects others
        models[arch] = (str(target_dir), str(draft_dir))
    spec = json.dumps({"models": models, "prompts": prompts, "k": K, "batch": MAX_BATCH, "cache_len": CACHE_LEN})
    address = f"127.0.0.1:{server_port()}"  # (rank 0 binds it)
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", RANK, str(rank), address, spec],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        for rank in range(2)
    ]
    outputs = []
    for proc in ranks:
        text, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0, text[-3000:]
        outputs.append(json.loads(next(line for line in text.splitlines() if line.startswith("RESULT "))[7:]))
        for loaded, _ in models.values():
            assert f"of 2 read its shard of {loaded} alone" in text, "the rank read its shard, not the whole model"
    assert outputs[0] == outputs[1], "the ranks emitted different tokens"
    for arch in ARCHS:
        target = tiny_models.target(arch)
        expected = [hf_reference(target, p, m) for p, m in prompts]
        assert outputs[0][arch]["tokens"] == expected, arch
        assert outputs[0][arch]["tokens"] == _offline(target, tiny_models.noisy_draft(arch), prompts), arch
        heads = getattr(target.config, "num_key_value_heads", None) or target.config.num_attention_heads
        assert outputs[0][arch]["kv_heads"] == heads // 2, "each rank's cache holds its half of the K/V heads"


def test_heads_that_do_not_split_are_refused(tiny_models, tmp_path: Path) -> None:
    tiny_models.target("llama", heads=4, kv_heads=1).save_pretrained(tmp_path / "m")
    model = load_model(str(tmp_path / "m"), dtype="float32")
    with pytest.raises(ModelLoadError, match="1 key/value heads, which 2 tensor-parallel ranks cannot split"):
        shard_model(model, TensorParallel(rank=0, size=2))


def test_each_rank_takes_the_next_device() -> None:
    assert [rank_device("cuda:1", r) for r in range(3)] == ["cuda:1", "cuda:2", "cuda:3"]
    assert rank_device("cuda", 1) == "cuda:1" and rank_device("cpu", 3) == "cpu"
    with pytest.raises(ModelLoadError, match="lists several devices"):
        rank_device("cuda:0,cuda:1", 0)


def test_a_rank_silent_or_behind_is_hung_and_a_long_call_is_not() -> None:
    """`Liveness` (rank 0's watch over ranks 1..N-1), on a clock of its own: silence beyond HANG_S is a stopped
    rank; a call rank 0 finished that a rank has not is a stuck rank only HANG_S plus twice rank 0's time later;
    a rank loading its shard, or running a long call rank 0 runs too, is not hung."""
    live = Liveness(2)
    assert live.hung(1000.0) is None  # loading: not watched until it reports or rank 0 hands on a call
    live.report(1, 0, 0, 0.0)
    assert live.hung(HANG_S - 0.1) is None
    assert live.hung(HANG_S + 0.1) == (1, f"has not reported for {HANG_S + 0.1:.1f} s (stopped, or hung)")
    live.report(1, 0, 0, 10.0)
    call = live.send(10.0)  # rank 2, silent so far, is watched from here
    assert call == 1 and live.hung(10.0 + HANG_S + 0.1) is not None
    for now in (11.0, 12.0, 13.0, 40.0, 70.0):  # a 60 s call: both ranks report on, as rank 0 runs it too
        live.report(1, 0, 0, now)
        live.report(2, 0, 0, now)
        assert live.hung(now) is None
    live.finished(call, 60.0, 70.0)  # rank 0 done after 60 s: the others have until 70 + HANG_S + 120
    end = 70.0 + HANG_S + 120
    for now in (72.0, 130.0, end - 1):
        live.report(1, 1, 0, now)
        live.report(2, 0, 0, now)
        assert live.hung(now) is None
    live.report(1, 1, 0, end + 1)
    live.report(2, 0, 0, end + 1)
    assert live.hung(end + 1) == (2, "has not finished call 1 long after rank 0 did (stuck)")
    live.report(2, 1, 0, end + 2)
    assert live.hung(end + 2) is None


def test_a_rank_that_does_not_reach_an_all_reduce_is_hung() -> None:
    """Rank 0 waiting in an all-reduce that a rank, reporting on, has not begun: stuck once the wait is longer than
    HANG_S plus twice what rank 0 took to get there from the last one; a rank that reaches it is not."""
    live = Liveness(2)
    rank0 = Progress(entered=5, waiting_since=100.0, synced=99.0)  # 1 s of work, then waiting in all-reduce 5
    live.report(1, 0, 5, 100.0)
    live.report(2, 0, 4, 100.0)
    for now in (101.0, 100.0 + HANG_S + 2 - 0.1):
        live.report(1, 0, 5, now)
        live.report(2, 0, 4, now)
        assert live.hung(now, rank0) is None
    now = 100.0 + HANG_S + 2 + 0.1
    live.report(1, 0, 5, now)
    live.report(2, 0, 4, now)
    assert live.hung(now, rank0) == (2, f"has not reached all-reduce 5 {now - 100:.1f} s after rank 0 (stuck)")
    live.report(2, 0, 5, now)
    assert live.hung(now, rank0) is None
    assert live.hung(now, Progress(entered=5, waiting_since=None, synced=now)) is None  # (not waiting)


def test_a_device_list_is_refused_for_tensor_parallel(tmp_path: Path) -> None:
    """The layer-by-layer device map is gone: a list of devices names the flag that spreads a model over GPUs."""
    with pytest.raises(ModelLoadError, match="runs tensor parallel, e.g. --device cuda:0 --tensor-parallel-size 2"):
        load_model(str(tmp_path), "cuda:0,cuda:1")
