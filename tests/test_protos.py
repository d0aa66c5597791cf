"""The protos lint clean, the committed generated code is current, and the generated modules work."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
GENERATOR = REPO_ROOT / "scripts" / "generate_protos.py"


def _require_grpc_tools() -> None:
    if importlib.util.find_spec("grpc_tools") is None:
        pytest.skip("grpc_tools (grpcio-tools, dev extra) is not installed: cannot regenerate the protos")


def _load_generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("generate_protos", GENERATOR)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_generated_code_is_not_stale() -> None:
    _require_grpc_tools()
    result = subprocess.run(
        [sys.executable, str(GENERATOR), "--check"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, (
        "committed generated code differs from protos/; run `python scripts/generate_protos.py`\n"
        + result.stdout
        + result.stderr
    )


def test_check_mode_reports_stale_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _require_grpc_tools()
    generator = _load_generator()
    out = tmp_path / "minedraft" / "proto"
    shutil.copytree(REPO_ROOT / "minedraft" / "proto", out, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(generator, "REPO_ROOT", tmp_path)
    monkeypatch.setattr(generator, "OUTPUT_ROOT", out)
    assert generator.main(["--check"]) == 0

    stale = out / "minedraft" / "v1" / "target_pb2.py"
    stale.write_text(stale.read_text() + "# edited\n")
    (out / "minedraft" / "v1" / "draft_pb2.pyi").unlink()
    (out / "minedraft" / "v1" / "old_pb2.py").write_text("")
    assert generator.main(["--check"]) == 1

    assert generator.main([]) == 0
    assert not (out / "minedraft" / "v1" / "old_pb2.py").exists()
    assert generator.main(["--check"]) == 0


def test_buf_lint_passes() -> None:
    buf = shutil.which("buf")
    if buf is None:
        pytest.skip("`buf` is not on PATH (pip install buf-bin)")
    result = subprocess.run([buf, "lint"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def test_messages_round_trip() -> None:
    from minedraft.proto import common_pb2, draft_pb2, generation_pb2, target_pb2

    request = generation_pb2.GenerateRequest(
        prompt_token_ids=[1, 2, 3],
        params=generation_pb2.SamplingParams(
            max_tokens=32, temperature=0.5, top_k=20, seed=0, stop=["\n\n"], stop_token_ids=[7]
        ),
        request_id="r1",
    )
    decoded = generation_pb2.GenerateRequest.FromString(request.SerializeToString())
    assert decoded == request
    assert decoded.params.HasField("seed") and decoded.params.seed == 0
    assert not generation_pb2.SamplingParams().HasField("seed")

    response = generation_pb2.GenerateResponse(
        token_ids=[5, 6],
        text="hi",
        finish_reason=generation_pb2.FINISH_REASON_LENGTH,
        usage=generation_pb2.Usage(completion_tokens=2, accepted_per_position=[3, 1], time_to_first_token_s=0.25),
    )
    assert generation_pb2.GenerateResponse.FromString(response.SerializeToString()) == response

    drafts = common_pb2.DraftPayload(
        channel="grpc",
        step_id=9,
        batch_size=2,
        num_tokens=4,
        token_ids=bytes(range(32)),
        probs_shape=[2, 4, 10],
        probs_dtype="float16",
    )
    propose = draft_pb2.ProposeResponse(drafts=drafts, timings=common_pb2.Timings(compute_s=0.01))
    propose = draft_pb2.ProposeResponse.FromString(propose.SerializeToString())
    # The coordinator copies the draft's payload into the target's request unchanged.
    verify = target_pb2.VerifyRequest(
        step_id=9, batch_id=1, seq_ids=[10, 11], drafts=propose.drafts, num_draft_tokens=4
    )
    decoded_verify = target_pb2.VerifyRequest.FromString(verify.SerializeToString())
    assert decoded_verify.drafts == drafts
    assert type(decoded_verify).__module__ == "minedraft.proto.minedraft.v1.target_pb2"

    prefill = target_pb2.TargetServicePrefillRequest(
        sequences=[common_pb2.SequenceSpec(seq_id=1, prompt_token_ids=[4], params=generation_pb2.SamplingParams())]
    )
    assert target_pb2.TargetServicePrefillRequest.FromString(prefill.SerializeToString()) == prefill


def test_services_shape() -> None:
    from minedraft.proto import draft_pb2, generation_pb2, target_pb2

    generation = generation_pb2.DESCRIPTOR.services_by_name["GenerationService"]
    assert generation.full_name == "minedraft.v1.GenerationService"
    assert generation.methods_by_name["Generate"].server_streaming
    assert set(generation.methods_by_name) == {"Generate", "GetServerInfo"}
    target = target_pb2.DESCRIPTOR.services_by_name["TargetService"]
    assert set(target.methods_by_name) == {
        "GetInfo",
        "SetupChannel",
        "Prepare",
        "Prefill",
        "Verify",
        "VerifyStream",
        "Release",
        "Lease",
    }
    draft = draft_pb2.DESCRIPTOR.services_by_name["DraftService"]
    assert set(draft.methods_by_name) == {
        "GetInfo",
        "SetupChannel",
        "Prepare",
        "Prefill",
        "Propose",
        "ProposeStream",
        "Release",
        "Lease",
    }
    for method in (target.methods_by_name["VerifyStream"], draft.methods_by_name["ProposeStream"]):
        assert method.client_streaming and method.server_streaming


def test_lifecycle_messages_match_between_the_services() -> None:
    # One servicer base (minedraft/rpc/worker_servicer.py) serves both: it reads each service's requests alike.
    from minedraft.proto import draft_pb2, target_pb2

    def fields(descriptor: Any) -> list[tuple[str, int, int, bool, str]]:
        return [
            (f.name, f.number, f.type, f.is_repeated, f.message_type.full_name if f.message_type else "")
            for f in descriptor.fields
            if f.name != "from_target"  # the draft's alone: the target's tensors for it, which its own code reads
        ]

    target = target_pb2.DESCRIPTOR.services_by_name["TargetService"].methods_by_name
    draft = draft_pb2.DESCRIPTOR.services_by_name["DraftService"].methods_by_name
    for name in ("GetInfo", "SetupChannel", "Prepare", "Prefill", "Release"):
        assert fields(target[name].input_type) == fields(draft[name].input_type), name
        if name != "Prefill":  # the target's prefill replies with first tokens, the draft's with timings only
            assert fields(target[name].output_type) == fields(draft[name].output_type), name


def test_grpc_modules_import_on_every_patch_release() -> None:
    # The generator lowers the grpcio floor of *_pb2_grpc.py to X.Y.0 (the GPU machines run grpcio 1.84.0).
    from minedraft.proto import draft_pb2_grpc, generation_pb2_grpc, target_pb2_grpc

    for module in (draft_pb2_grpc, generation_pb2_grpc, target_pb2_grpc):
        assert module.GRPC_GENERATED_VERSION.endswith(".0"), module.__name__


def test_generated_grpc_code_serves_over_loopback() -> None:
    import grpc

    from minedraft.proto import generation_pb2, generation_pb2_grpc

    class Servicer(generation_pb2_grpc.GenerationServiceServicer):
        def Generate(
            self, request: generation_pb2.GenerateRequest, context: grpc.ServicerContext
        ) -> Iterator[generation_pb2.GenerateResponse]:
            for token in request.prompt_token_ids:
                yield generation_pb2.GenerateResponse(token_ids=[token])
            yield generation_pb2.GenerateResponse(
                finish_reason=generation_pb2.FINISH_REASON_STOP,
                usage=generation_pb2.Usage(completion_tokens=len(request.prompt_token_ids)),
            )

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    generation_pb2_grpc.add_GenerationServiceServicer_to_server(Servicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = generation_pb2_grpc.GenerationServiceStub(channel)
            replies = list(stub.Generate(generation_pb2.GenerateRequest(prompt_token_ids=[3, 4]), timeout=30))
            assert [list(r.token_ids) for r in replies] == [[3], [4], []]
            assert replies[-1].finish_reason == generation_pb2.FINISH_REASON_STOP
            assert replies[-1].usage.completion_tokens == 2
            with pytest.raises(grpc.RpcError) as error:
                stub.GetServerInfo(generation_pb2.GetServerInfoRequest(), timeout=30)
            assert error.value.code() == grpc.StatusCode.UNIMPLEMENTED
    finally:
        server.stop(grace=None)
