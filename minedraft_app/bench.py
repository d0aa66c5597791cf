"""`minedraft bench`: load generator for a running server, and side-by-side comparison of the modes."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import glob
import json
import os
import random
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import grpc

from minedraft.observability.metrics import mean_accepted_length
from minedraft.rpc.security import ClientTls, aio_channel, bearer_metadata, client_tls, sync_channel
from minedraft_app.stack import free_port, start_stack, stop_processes

MODES = ("psd", "sd", "sd2b", "sddp", "ar")
SD_2B = "sd2b"  # sd at the same total concurrency as psd: one batch of 2 x max_batch_size
# sd on two independent stacks, one on each of psd's devices (--target-device, --draft-device), each holding target
# and draft, the load's streams split evenly between them: what a user with two GPUs would run behind a load balancer
SD_DP = "sddp"
Send = Callable[[str, int], Awaitable["RequestResult"]]  # one request (prompt, index), measured


# --------------------------------------------------------------------------------------------- prompts


def _corpus(chars: int) -> str:
    """Real text: stdlib Python sources, in a fixed order, about `chars` characters of them."""
    parts: list[str] = []
    size = 0
    for path in sorted(glob.glob(os.path.join(os.path.dirname(os.__file__), "*.py"))):
        try:
            text = Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        parts.append(text)
        size += len(text)
        if size >= chars:
            break
    return "\n".join(parts)


def _load_tokenizer(directory: str | None) -> Any:
    if not directory or not os.path.isdir(directory):
        return None
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(directory, local_files_only=True)
    except (OSError, ValueError):
        return None


def make_prompts(count: int, prompt_len: int, seed: int, tokenizer: Any, kind: str = "corpus") -> list[str]:
    """`count` text prompts cut from stdlib sources at seeded random places, each about `prompt_len` tokens.

    With a tokenizer the cut is `prompt_len` tokens decoded back to text (the server re-tokenizes it, which can
    differ by a token or two at the edges); without one it is 4 characters per token. `kind` "quote": a passage of
    three quarters of that, then its first third again (the rest of the passage is what quoting it goes on with).
    """
    rng = random.Random(seed)
    corpus = _corpus(max(400_000, count * prompt_len * 8))
    if tokenizer is not None:
        tokenizer.model_max_length = 1 << 40  # the corpus is one long text: no "longer than the maximum" warning
        units: Any = tokenizer.encode(corpus, add_special_tokens=False)
        length = prompt_len
    else:
        units, length = corpus, 4 * prompt_len
    passage = length if kind == "corpus" else length * 3 // 4
    starts = [rng.randrange(0, max(1, len(units) - passage)) for _ in range(count)]
    cuts = [units[s : s + passage] for s in starts]
    if kind == "quote":
        cuts = [cut + cut[: len(cut) // 3] for cut in cuts]
    return [tokenizer.decode(cut) for cut in cuts] if tokenizer is not None else list(cuts)


# --------------------------------------------------------------------------------------------- load


@dataclass
class RequestResult:
    ok: bool
    latency_s: float
    ttft_s: float | None = None
    tpot_s: float | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    steps: int = 0
    drafted_steps: int = 0
    error: str = ""


def _request(prompt: str, index: int, args: argparse.Namespace) -> Any:
    from minedraft.proto import generation_pb2

    params = generation_pb2.SamplingParams(
        max_tokens=args.output_len,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=(args.seed + index) % 2**64,
        ignore_eos=True,
    )
    return generation_pb2.GenerateRequest(prompt=prompt, params=params, request_id=f"bench-{index}")


async def _one(stub: Any, request: Any, timeout: float, metadata: Sequence[tuple[str, str]] = ()) -> RequestResult:
    start = time.perf_counter()
    first: float | None = None
    tokens = 0
    usage = None
    try:
        async for message in stub.Generate(request, timeout=timeout, metadata=metadata):
            if message.token_ids and first is None:
                first = time.perf_counter()
            tokens += len(message.token_ids)
            if message.finish_reason:
                usage = message.usage
    except grpc.aio.AioRpcError as exc:
        return RequestResult(False, time.perf_counter() - start, error=f"{exc.code().name}: {exc.details()}")
    end = time.perf_counter()
    result = RequestResult(True, end - start, completion_tokens=tokens)
    if first is not None:
        result.ttft_s = first - start
        if tokens > 1:
            result.tpot_s = (end - first) / (tokens - 1)
    if usage is not None:
        result.prompt_tokens = usage.prompt_tokens
        result.draft_tokens = usage.draft_tokens
        result.accepted_tokens = usage.accepted_tokens
        result.steps = usage.steps
        result.drafted_steps = usage.drafted_steps
    return result


def _completion(prompt: str, index: int, model: str, args: argparse.Namespace) -> dict[str, Any]:
    """The /v1/completions arguments of `_request`'s request (the openai client's names; vLLM's extensions)."""
    return {
        "model": model,
        "prompt": prompt,
        "max_tokens": args.output_len,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "seed": (args.seed + index) % 2**64,
        "stream": True,
        "stream_options": {"include_usage": True},
        "extra_body": {"top_k": args.top_k, "ignore_eos": True},
    }


async def _one_http(client: Any, arguments: dict[str, Any]) -> RequestResult:
    """One streamed completion: TTFT at the first chunk with text, token counts and drafts from its usage."""
    import openai

    start = time.perf_counter()
    first: float | None = None
    usage = None
    try:
        async for chunk in await client.completions.create(**arguments):
            if first is None and chunk.choices and chunk.choices[0].text:
                first = time.perf_counter()
            if chunk.usage is not None:
                usage = chunk.usage
    except openai.APIError as exc:
        status = getattr(exc, "status_code", None)
        return RequestResult(False, time.perf_counter() - start, error=f"HTTP {status or '-'}: {exc.message}")
    end = time.perf_counter()
    if usage is None:
        return RequestResult(False, end - start, error="the stream ended without usage")
    tokens = usage.completion_tokens
    spec = (usage.model_extra or {}).get("speculation") or {}  # MineDraft's extension of usage
    result = RequestResult(
        True,
        end - start,
        prompt_tokens=usage.prompt_tokens,
        completion_tokens=tokens,
        draft_tokens=spec.get("draft_tokens", 0),
        accepted_tokens=spec.get("accepted_tokens", 0),
        steps=spec.get("steps", 0),
        drafted_steps=spec.get("drafted_steps", 0),
    )
    if first is not None:
        result.ttft_s = first - start
        if tokens > 1:
            result.tpot_s = (end - first) / (tokens - 1)
    return result


@contextlib.asynccontextmanager
async def _grpc_sender(address: str, args: argparse.Namespace) -> AsyncIterator[Send]:
    from minedraft.proto import generation_pb2_grpc
    from minedraft.rpc.server_utils import CHANNEL_OPTIONS

    metadata = bearer_metadata(args.api_key)
    async with aio_channel(address, _client_tls(args), CHANNEL_OPTIONS) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)

        async def send(prompt: str, index: int) -> RequestResult:
            return await _one(stub, _request(prompt, index, args), args.timeout, metadata)

        yield send


@contextlib.asynccontextmanager
async def _http_sender(base_url: str, args: argparse.Namespace) -> AsyncIterator[Send]:
    try:
        import openai
    except ImportError as exc:
        raise RuntimeError("--api http drives the HTTP API with the openai client: pip install openai") from exc
    api_key = args.api_key or os.environ.get("OPENAI_API_KEY", "none")
    async with openai.AsyncOpenAI(
        base_url=f"{base_url}/v1", api_key=api_key, max_retries=0, timeout=args.timeout
    ) as client:
        try:
            model = (await client.models.list()).data[0].id
        except openai.APIError as exc:
            raise RuntimeError(f"no model listed at {base_url}/v1/models: {exc}") from exc

        async def send(prompt: str, index: int) -> RequestResult:
            return await _one_http(client, _completion(prompt, index, model, args))

        yield send


async def run_load(
    address: str | Sequence[str], prompts: Sequence[str], args: argparse.Namespace, label: str
) -> tuple[list[RequestResult], float]:
    """Warm up, then send `prompts` with `args.concurrency` streams in flight; return the results and wall time.

    `address`: the gRPC server's, or with `--api http` the HTTP API's base URL; several: the streams take them in
    turn (each server warmed up alone first), and each stream sends its next request as its last one ends."""
    from tqdm import tqdm

    addresses = [address] if isinstance(address, str) else list(address)
    sender = _http_sender if args.api == "http" else _grpc_sender
    async with contextlib.AsyncExitStack() as senders:
        sends = [await senders.enter_async_context(sender(a, args)) for a in addresses]
        for send in sends:
            warm = [send(prompts[i % len(prompts)], len(prompts) + i) for i in range(args.num_warmup)]
            for result in await asyncio.gather(*warm):
                if not result.ok:
                    raise RuntimeError(f"warm-up request failed: {result.error}")
        pending = iter(list(enumerate(prompts)))
        results: list[RequestResult] = []
        bar = tqdm(total=len(prompts), desc=label, unit="req", disable=args.no_progress, file=sys.stderr)

        async def client(send: Send) -> None:
            for index, prompt in pending:
                results.append(await send(prompt, index))
                bar.update(1)

        start = time.perf_counter()
        await asyncio.gather(*(client(sends[i % len(sends)]) for i in range(max(1, args.concurrency))))
        wall = time.perf_counter() - start
        bar.close()
    return results, wall


# --------------------------------------------------------------------------------------------- metrics


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (q in [0, 100]); NaN for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


@dataclass
class Summary:
    label: str
    completed: int
    failed: int
    wall_s: float
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    mean_prompt_tokens: float
    mean_output_tokens: float
    ttft_ms: dict[str, float]
    tpot_ms: dict[str, float]
    latency_s: dict[str, float]
    mean_accepted_length: float
    acceptance_rate: float
    drafted_share: float  # of the verify steps: those that checked drafts (--speculation auto drafts at some)
    errors: list[str] = field(default_factory=list)
    server: dict[str, Any] = field(default_factory=dict)


def summarize(label: str, results: Sequence[RequestResult], wall: float, server: dict[str, Any]) -> Summary:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.completion_tokens for r in ok)
    prompt_tokens = sum(r.prompt_tokens for r in ok)
    steps = sum(r.steps for r in ok)
    drafted_steps = sum(r.drafted_steps for r in ok)
    drafts = sum(r.draft_tokens for r in ok)
    accepted = sum(r.accepted_tokens for r in ok)

    def pcts(values: list[float], scale: float) -> dict[str, float]:
        return {f"p{q}": round(percentile(values, q) * scale, 3) for q in (50, 90, 99)} | {
            "mean": round(sum(values) / len(values) * scale, 3) if values else float("nan")
        }

    return Summary(
        label=label,
        completed=len(ok),
        failed=len(results) - len(ok),
        wall_s=round(wall, 3),
        request_throughput=round(len(ok) / wall, 4) if wall > 0 else 0.0,
        output_throughput=round(out_tokens / wall, 3) if wall > 0 else 0.0,
        total_token_throughput=round((out_tokens + prompt_tokens) / wall, 3) if wall > 0 else 0.0,
        mean_prompt_tokens=round(prompt_tokens / len(ok), 2) if ok else 0.0,
        mean_output_tokens=round(out_tokens / len(ok), 2) if ok else 0.0,
        ttft_ms=pcts([r.ttft_s for r in ok if r.ttft_s is not None], 1e3),
        tpot_ms=pcts([r.tpot_s for r in ok if r.tpot_s is not None], 1e3),
        latency_s=pcts([r.latency_s for r in ok], 1.0),
        # Over the drafted verify steps of all requests: tokens such a step emitted (accepted drafts + 1).
        mean_accepted_length=round(mean_accepted_length(accepted, drafted_steps, steps), 4),
        acceptance_rate=round(accepted / drafts, 4) if drafts else 0.0,
        drafted_share=round(drafted_steps / steps, 4) if steps else 0.0,
        errors=sorted({r.error for r in results if not r.ok})[:5],
        server=server,
    )


def format_summary(s: Summary) -> str:
    srv = s.server
    head = f"== {s.label} =="
    if "mode" in srv:
        head += (
            f"  mode {srv.get('mode')}, k={srv.get('num_speculative_tokens')}, max batch "
            f"{srv.get('max_batch_size')}, channel {srv.get('channel')}"
        )
    if srv.get("stacks", 1) > 1:
        head += f", {srv['stacks']} stacks sharing the load"
    if srv.get("api") == "http":
        head += ("," if "mode" in srv else " ") + f" over the HTTP API (model {srv.get('target_model')})"
    lines = [
        head,
        f"  requests        {s.completed} ok, {s.failed} failed in {s.wall_s:.2f} s",
        f"  throughput      {s.request_throughput:.3f} req/s, {s.output_throughput:.1f} output tok/s, "
        f"{s.total_token_throughput:.1f} total tok/s",
        f"  tokens/request  {s.mean_prompt_tokens:.1f} prompt, {s.mean_output_tokens:.1f} output",
        "  TTFT (ms)       " + _pcts(s.ttft_ms),
        "  TPOT (ms)       " + _pcts(s.tpot_ms),
        "  latency (s)     " + _pcts(s.latency_s),
        f"  accepted length {s.mean_accepted_length:.3f} tokens per drafted step (acceptance "
        f"{100 * s.acceptance_rate:.1f}%, {100 * s.drafted_share:.1f}% of steps drafted)",
    ]
    lines += [f"  error: {e}" for e in s.errors]
    return "\n".join(lines)


def _pcts(values: dict[str, float]) -> str:
    return "  ".join(f"{k} {v:.2f}" for k, v in values.items())


def ratios(summaries: dict[str, Summary]) -> dict[str, dict[str, float]]:
    """Throughput ratios of the pairs that were measured (request/s and output tokens/s)."""
    pairs = [("psd", "sd"), ("psd", SD_2B), ("psd", SD_DP), ("sd", "ar"), (SD_2B, "ar"), ("psd", "ar")]
    out: dict[str, dict[str, float]] = {}
    for a, b in pairs:
        if a in summaries and b in summaries and summaries[b].output_throughput > 0:
            out[f"{a}/{b}"] = {
                "request_throughput": round(summaries[a].request_throughput / summaries[b].request_throughput, 3),
                "output_throughput": round(summaries[a].output_throughput / summaries[b].output_throughput, 3),
            }
    return out


def format_comparison(summaries: dict[str, Summary], measured: dict[str, dict[str, float]]) -> str:
    lines = [
        "",
        "mode     req/s     out tok/s  TTFT p50 ms  TPOT p50 ms  TPOT p99 ms  accepted len",
        "-------  --------  ---------  -----------  -----------  -----------  ------------",
    ]
    for name, s in summaries.items():
        lines.append(
            f"{name:<7}  {s.request_throughput:8.3f}  {s.output_throughput:9.1f}  "
            f"{s.ttft_ms['p50']:11.2f}  {s.tpot_ms['p50']:11.2f}  {s.tpot_ms['p99']:11.2f}  "
            f"{s.mean_accepted_length:12.3f}"
        )
    if measured:
        lines.append("")
        for pair, r in measured.items():
            lines.append(
                f"{pair:<9} throughput ratio {r['request_throughput']:.3f} (requests/s), "
                f"{r['output_throughput']:.3f} (output tokens/s)"
            )
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------- stacks


def _client_tls(args: argparse.Namespace | None) -> ClientTls | None:
    """TLS to the server measured, with bench's --tls-ca (its local stacks get none: `LocalStack`)."""
    return client_tls(args.tls_ca, server_name=args.tls_server_name) if args is not None else None


def _server_info(address: str, args: argparse.Namespace | None = None) -> dict[str, Any]:
    """The server's GetServerInfo, through bench's TLS and token where `args` has them."""
    from google.protobuf.json_format import MessageToDict

    from minedraft.proto import generation_pb2, generation_pb2_grpc

    with sync_channel(address, _client_tls(args)) as channel:
        reply = generation_pb2_grpc.GenerationServiceStub(channel).GetServerInfo(
            generation_pb2.GetServerInfoRequest(),
            timeout=30,
            metadata=bearer_metadata(args.api_key if args is not None else None),
        )
    return MessageToDict(reply, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)


def http_base_url(address: str) -> str:
    """The HTTP API's base URL from `host:port` or a URL (with or without its /v1)."""
    url = address if "://" in address else f"http://{address}"
    return url.rstrip("/").removesuffix("/v1")


def _http_info(base_url: str, timeout: float = 60.0) -> dict[str, Any]:
    """What the HTTP API says of itself (its model), once its /health answers 200 (within `timeout` seconds: a
    stack's starts just after its gRPC server serves)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(f"{base_url}/health", timeout=10) as reply:
                if reply.status == 200:
                    break
        except OSError as exc:  # refused, or 503 (HTTPError) while it starts
            if time.monotonic() > deadline:
                raise RuntimeError(f"the HTTP API at {base_url} is not serving: {exc}") from exc
        time.sleep(0.1)
    with urllib.request.urlopen(f"{base_url}/v1/models", timeout=30) as reply:
        model = json.loads(reply.read())["data"][0]
    return {"api": "http", "target_model": model["id"], "max_model_len": model.get("max_model_len")}


class LocalStack:
    """target, draft (not in ar) and coordinator processes, as `minedraft serve` starts them; stopped by SIGINT.
    `device`: target and draft both on it (one stack of `sddp`), `name` then tells its log and trace apart."""

    def __init__(
        self, args: argparse.Namespace, mode: str, log_dir: Path, device: str | None = None, name: str | None = None
    ) -> None:
        self.mode = "sd" if mode in (SD_2B, SD_DP) else mode
        name = name or mode
        batch = args.max_batch_size * (2 if mode == SD_2B else 1)
        max_len = args.max_model_len or _default_max_len(args)
        self.port = 0  # the coordinator's, known once started
        for_mode = {  # what `serve` takes beyond bench's flags, or otherwise for this mode
            "mode": self.mode,
            "max_batch_size": batch,
            "max_model_len": max_len,
            "max_queue_size": max(256, args.num_prompts + args.num_warmup),
            "step_trace": str(Path(args.step_trace_dir) / f"{name}.jsonl") if args.step_trace_dir else None,
            "port": 0,
            "host": "127.0.0.1",
            "tls_ca": None,  # bench's --tls-ca checks --server's certificate; its own stacks are plaintext
            # --api http: the load goes to the HTTP API, on a free port unless --http-port names one (sddp's two
            # stacks: free ports)
            "http_port": ((args.http_port if name == mode else None) or free_port())
            if args.api == "http"
            else args.http_port,
        }
        if device is not None:
            for_mode |= {"target_device": device, "draft_device": device}
        self.args = argparse.Namespace(**(vars(args) | for_mode))  # as `serve` would hold them
        self.env = dict(os.environ)
        if args.threads:
            self.env["OMP_NUM_THREADS"] = self.env["MKL_NUM_THREADS"] = str(args.threads)
        self.log_path = log_dir / f"{name}.log"
        self.processes: list[subprocess.Popen] = []

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.args.http_port}"

    def start(self) -> None:
        with open(self.log_path, "w") as log:

            def popen(command: list[str]) -> subprocess.Popen:
                return subprocess.Popen(
                    command, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
                )

            self.port = start_stack(self.args, popen, self.processes)

    def stop(self) -> None:
        stop_processes(self.processes)
        self.processes = []

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""


def _default_max_len(args: argparse.Namespace) -> int:
    need = 2 * args.prompt_len + args.output_len + args.num_speculative_tokens + 16  # re-tokenized prompts vary
    return -(-need // 64) * 64


def _parse_modes(args: argparse.Namespace) -> list[str]:
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if args.sd_batch_equal_concurrency and SD_2B not in modes:
        modes.insert(modes.index("sd") + 1 if "sd" in modes else len(modes), SD_2B)
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        raise ValueError(f"unknown mode(s) {', '.join(bad) or '(none)'}: choose among {', '.join(MODES)}")
    if SD_DP in modes:
        devices = {"cuda:0" if d == "cuda" else d for d in (args.target_device, args.draft_device)}
        if len(devices) == 1 and devices != {"cpu"}:
            raise ValueError(f"{SD_DP} runs a stack on each of --target-device and --draft-device: name two GPUs")
        if max(args.tensor_parallel_size or 1, args.draft_tensor_parallel_size or 1) > 1:
            raise ValueError(f"{SD_DP} runs each stack on one device: it takes no tensor parallelism")
    return list(dict.fromkeys(modes))


def mode_stacks(args: argparse.Namespace, mode: str, log_dir: Path) -> list[LocalStack]:
    """The stacks a mode runs on: one, or for `sddp` one per device of psd's pair."""
    if mode != SD_DP:
        return [LocalStack(args, mode, log_dir)]
    devices = (args.target_device, args.draft_device)
    return [LocalStack(args, mode, log_dir, device, f"{mode}{i}") for i, device in enumerate(devices)]


# --------------------------------------------------------------------------------------------- main


def bench_main(args: argparse.Namespace) -> int:
    if args.concurrency is None:
        args.concurrency = 2 * args.max_batch_size
    if args.num_prompts < 1 or args.output_len < 1 or args.prompt_len < 1:
        print("error: --num-prompts, --prompt-len and --output-len must be positive", file=sys.stderr)
        return 2
    summaries: dict[str, Summary] = {}  # filled mode by mode: an interrupted run keeps the modes it finished
    try:
        (_bench_modes if args.modes else _bench_server)(args, summaries)
    except (RuntimeError, TimeoutError, ValueError, grpc.RpcError) as exc:
        detail = str(exc)
        if isinstance(exc, grpc.RpcError):
            detail = f"{exc.code().name}: {exc.details()}"  # type: ignore[attr-defined]
        print(f"error: {detail}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        if summaries:
            print(f"interrupted: reporting the modes that finished ({', '.join(summaries)})", file=sys.stderr)
            _report(args, summaries, interrupted=True)
        return 130
    _report(args, summaries, interrupted=False)
    failed = sum(s.failed for s in summaries.values())
    return 1 if failed else 0


def _report(args: argparse.Namespace, summaries: dict[str, Summary], interrupted: bool) -> None:
    """The comparison table, and the JSON report with --json-out."""
    measured = ratios(summaries)
    print(format_comparison(summaries, measured), flush=True)
    if args.json_out:
        report = {
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "command": ["minedraft", *sys.argv[1:]] if sys.argv else [],
            "config": {k: v for k, v in vars(args).items() if k != "func"},
            "results": {name: asdict(s) for name, s in summaries.items()},
            "ratios": measured,
            "interrupted": interrupted,
        }
        Path(args.json_out).write_text(json.dumps(_no_nan(report), indent=2) + "\n")


def _no_nan(value: Any) -> Any:
    """Strict JSON: a statistic of no values (NaN) becomes null."""
    if isinstance(value, float) and value != value:
        return None
    if isinstance(value, dict):
        return {k: _no_nan(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_no_nan(v) for v in value]
    return value


def _bench_server(args: argparse.Namespace, summaries: dict[str, Summary]) -> None:
    """The load against a running server; its summary goes into `summaries`."""
    if args.api == "http":
        address = http_base_url(args.server or "localhost:8000")
        info = _http_info(address, timeout=0.0)  # a running server: serving now, or an error
    else:
        address = args.server or "localhost:50051"
        info = _server_info(address, args)
    tokenizer = _load_tokenizer(args.tokenizer or info.get("target_model"))
    prompts = make_prompts(args.num_prompts, args.prompt_len, args.seed, tokenizer, args.prompt_kind)
    label = info.get("mode", args.api)
    results, wall = asyncio.run(run_load(address, prompts, args, label))
    summaries[label] = summarize(label, results, wall, info)
    print(format_summary(summaries[label]), flush=True)


def _bench_modes(args: argparse.Namespace, summaries: dict[str, Summary]) -> None:
    """Each mode on a local stack of its own, one after the other; each one's summary goes into `summaries` as it
    ends."""
    modes = _parse_modes(args)
    for name, path in (("target", args.target), ("draft", args.draft)):
        if (name == "target" or any(m != "ar" for m in modes)) and not os.path.isdir(path):
            raise ValueError(
                f"no {name} model directory at {path}: pass --{name} DIR (the demo pair is made by "
                "scripts/train_demo_pair.py)"
            )
    tokenizer = _load_tokenizer(args.tokenizer or args.target)
    prompts = make_prompts(args.num_prompts, args.prompt_len, args.seed, tokenizer, args.prompt_kind)
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="minedraft-bench-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    if args.step_trace_dir:
        Path(args.step_trace_dir).mkdir(parents=True, exist_ok=True)
    print(
        f"modes {', '.join(modes)}: {args.num_prompts} prompts of ~{args.prompt_len} tokens, {args.output_len} "
        f"output tokens, concurrency {args.concurrency}; service logs in {log_dir}",
        flush=True,
    )
    if args.synthetic_acceptance is not None:
        print(
            f"BENCHMARK ONLY: synthetic acceptance {args.synthetic_acceptance}, outputs are not the target's",
            flush=True,
        )
    if args.synthetic_row_acceptance:
        print(
            f"BENCHMARK ONLY: synthetic acceptance by row ({args.synthetic_row_acceptance}, each row's rate picked by "
            f"its seed{' anew each step' if args.synthetic_rate_by == 'step' else ''}, which the draft's scores "
            "predict), outputs are not the target's",
            flush=True,
        )
    for mode in modes:
        stacks = mode_stacks(args, mode, log_dir)
        try:
            start = time.perf_counter()
            for stack in stacks:  # (here, not on threads: a Ctrl-C in a thread's start left its stack running)
                stack.start()
            print(f"{mode}: services up in {time.perf_counter() - start:.1f} s", flush=True)
            info = _server_info(stacks[0].address, stacks[0].args) | {"api": args.api, "stacks": len(stacks)}
            addresses = [stack.address for stack in stacks]
            if args.api == "http":
                addresses = [stack.http_url for stack in stacks]
                for address in addresses:
                    _http_info(address)
            plain = argparse.Namespace(**(vars(args) | {"tls_ca": None}))  # its own stack serves no TLS
            results, wall = asyncio.run(run_load(addresses, prompts, plain, mode))
            summaries[mode] = summarize(mode, results, wall, info)  # kept, even if stopping the stack is interrupted
        except (RuntimeError, TimeoutError, grpc.RpcError) as exc:
            logs = "".join(f"\n--- {stack.log_path} ---\n{stack.log_tail()}" for stack in stacks)
            raise RuntimeError(f"{mode}: {exc}{logs}") from exc
        finally:
            start = time.perf_counter()
            for stack in stacks:
                stack.stop()
            print(f"{mode}: services stopped in {time.perf_counter() - start:.1f} s", flush=True)
        print(format_summary(summaries[mode]), flush=True)
