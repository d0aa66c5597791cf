"""A real `minedraft serve` with no model flags (the shipped demo pair) and a `minedraft generate --json` round trip."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import grpc
import pytest
from stack import server_port

from minedraft.demo_models import EAGLE_DIR, TARGET_DIR, available
from minedraft.proto import generation_pb2, generation_pb2_grpc
from minedraft_app.stack import wait_healthy

pytestmark = pytest.mark.skipif(not available(), reason="the demo pair is not in minedraft/demo_models")


def _start_serve(
    args: list[str], env: dict[str, str]
) -> tuple[subprocess.Popen[str], list[str], threading.Event, threading.Thread]:
    """`minedraft serve` in a session of its own, its output read into `lines` by `reader`; `serving` is set once it
    prints its public address (all services up)."""
    serve = subprocess.Popen(
        args, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    lines: list[str] = []
    serving = threading.Event()

    def read_output() -> None:
        assert serve.stdout is not None
        for line in serve.stdout:
            lines.append(line)
            if line.startswith("minedraft serving"):
                serving.set()

    reader = threading.Thread(target=read_output, daemon=True)
    reader.start()
    return serve, lines, serving, reader


def test_serve_demo_pair_and_generate_json() -> None:
    """`serve --port 0`: every service, the public coordinator too, binds a port of its own choosing. A SIGTERM
    (a container's stop) then lets the request in flight finish before all three stop."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MINEDRAFT_HTTP_PORT": "0"}
    serve, lines, serving, reader = _start_serve(
        [
            sys.executable,
            "-m",
            "minedraft_app",
            "serve",
            "--port",
            "0",
            "--host",
            "127.0.0.1",
            "--max-batch-size",
            "4",
            "--max-model-len",
            "512",
        ],
        env,
    )
    try:
        assert serving.wait(timeout=240), "".join(lines)  # serve prints the public address once all are up
        found = re.search(r"minedraft serving psd on localhost:(\d+) ", "".join(lines))
        assert found, "".join(lines)
        port = int(found.group(1))
        assert port != 0
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "minedraft_app",
                "generate",
                "--server",
                f"127.0.0.1:{port}",
                "--prompt",
                "def fib(n):",
                "--max-tokens",
                "32",
                "--ignore-eos",
                "--json",
            ],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert result.returncode == 0, result.stderr
        answer = json.loads(result.stdout)
        assert answer["finish_reason"] == "length"
        assert len(answer["token_ids"]) == 32 and answer["text"]
        usage = answer["usage"]
        assert usage["completion_tokens"] == 32 and usage["prompt_tokens"] > 0
        assert usage["steps"] >= 1 and usage["draft_tokens"] == 4 * usage["steps"] == 4 * usage["drafted_steps"]
        # The distilled draft agrees with the target often: speculation really happens.
        assert usage["accepted_tokens"] > 0
        assert usage["mean_accepted_length"] == pytest.approx(
            1 + usage["accepted_tokens"] / usage["drafted_steps"], 1e-3
        )
        assert _tokens_streamed_across_a_sigterm(serve, f"127.0.0.1:{port}", 200) == (200, "FINISH_REASON_LENGTH")
        serve.wait(timeout=60)
    finally:
        if serve.poll() is None:
            serve.send_signal(signal.SIGINT)
            serve.wait(timeout=60)
        reader.join(timeout=10)
    output = "".join(lines)
    assert serve.returncode == 0, output  # all three stopped cleanly
    assert "draining: 1 requests to finish" in output, output


def _tokens_streamed_across_a_sigterm(serve: subprocess.Popen, address: str, max_tokens: int) -> tuple[int, str]:
    """Stream a request, SIGTERM `serve` after its first message; (tokens received, finish reason)."""
    request = generation_pb2.GenerateRequest(
        prompt="def fib(n):", params=generation_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    )
    with grpc.insecure_channel(address) as channel:
        stream = generation_pb2_grpc.GenerationServiceStub(channel).Generate(request, timeout=120)
        tokens, finish = 0, 0
        for i, message in enumerate(stream):
            if i == 0:
                serve.send_signal(signal.SIGTERM)
            tokens += len(message.token_ids)
            finish = message.finish_reason or finish
    return tokens, generation_pb2.FinishReason.Name(finish)


def _children(pid: int) -> list[int]:
    """Processes whose parent is `pid` (Linux /proc)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry))
    return found


def test_a_second_ctrl_c_stops_every_service_at_once() -> None:
    """Ctrl-C twice (an impatient operator) while `serve` stops its services: none of them is left running."""
    port = server_port()
    serve = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "minedraft_app",
            "serve",
            "--port",
            str(port),
            "--host",
            "127.0.0.1",
            "--max-batch-size",
            "2",
            "--max-model-len",
            "256",
        ],
        env={**os.environ, "OMP_NUM_THREADS": "1", "MINEDRAFT_HTTP_PORT": "0"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    services: list[int] = []
    try:
        wait_healthy(f"127.0.0.1:{port}", [serve], timeout=240)
        services = _children(serve.pid)
        assert len(services) == 3, services  # target, draft, coordinator
        serve.send_signal(signal.SIGINT)
        time.sleep(0.3)  # the first is stopping the coordinator
        serve.send_signal(signal.SIGINT)
        serve.wait(timeout=60)
        deadline = time.monotonic() + 15
        while any(_alive(pid) for pid in services) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not [pid for pid in services if _alive(pid)]
    finally:
        if serve.poll() is None:
            serve.kill()
        for pid in services:  # whatever a failure left behind
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def _alive(pid: int) -> bool:
    """Running, not a zombie waiting for its parent."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.skipif(not (EAGLE_DIR / "model.safetensors").is_file(), reason="no EAGLE head in minedraft/demo_models")
def test_serve_with_the_demo_eagle_head_matches_the_target_alone() -> None:
    """`serve --draft minedraft/demo_models/eagle` (the shipped head, `--speculative-method auto`, in one process):
    greedy output equals HF `generate()` of the demo target token for token, and the head's drafts are accepted
    about as often as the demo draft's (its training report: ~3 tokens a step at k=4 on held-out code)."""
    import torch
    from transformers import AutoModelForCausalLM

    from minedraft.engine.models import load_tokenizer

    prompts = ["def fib(n):", "class Queue:\n    def __init__(self, maxsize=0):\n"]
    target = AutoModelForCausalLM.from_pretrained(TARGET_DIR, dtype=torch.float32).eval()
    tokenizer = load_tokenizer(str(TARGET_DIR))
    expected = []
    for prompt in prompts:
        ids = torch.tensor([tokenizer(prompt)["input_ids"]])
        with torch.inference_mode():
            out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=64, do_sample=False)
        expected.append(out[0, ids.shape[1] :].tolist())
    serve, lines, serving, reader = _start_serve(
        [sys.executable, "-m", "minedraft_app", "serve", "--single-process", "--draft", str(EAGLE_DIR)]
        + ["--port", "0", "--host", "127.0.0.1", "--dtype", "float32", "--max-batch-size", "2"]
        + ["--max-model-len", "256", "--num-speculative-tokens", "4", "--speculation", "always"],
        {**os.environ, "OMP_NUM_THREADS": "1", "MINEDRAFT_HTTP_PORT": "0"},
    )
    try:
        assert serving.wait(timeout=240), "".join(lines)
        found = re.search(r"minedraft serving psd on localhost:(\d+) ", "".join(lines))
        assert found, "".join(lines)
        accepted = steps = 0
        with grpc.insecure_channel(f"127.0.0.1:{found.group(1)}") as channel:
            stub = generation_pb2_grpc.GenerationServiceStub(channel)
            for prompt, want in zip(prompts, expected, strict=True):
                params = generation_pb2.SamplingParams(max_tokens=len(want), temperature=0.0, ignore_eos=True)
                tokens: list[int] = []
                usage: generation_pb2.Usage | None = None
                for message in stub.Generate(generation_pb2.GenerateRequest(prompt=prompt, params=params), timeout=120):
                    tokens += message.token_ids
                    usage = message.usage if message.HasField("usage") else usage
                assert tokens == want, prompt
                assert usage is not None
                accepted, steps = accepted + usage.accepted_tokens, steps + usage.drafted_steps
        assert steps > 0 and 1 + accepted / steps > 2.0, (accepted, steps)  # a random head: about 1.0
    finally:
        serve.send_signal(signal.SIGINT)
        serve.wait(timeout=60)
        reader.join(timeout=10)
    assert serve.returncode == 0, "".join(lines)
